"""Does one explicit layout fit? Device memory per worker and host memory per node, before any actor starts.

`layout="auto"` goes through the planner, which returns only layouts that fit; an explicit
`ParallelLayout` is priced here with the planner's memory model (memory.py), for the one
configuration it names. Assumptions:

  * Degrees tp, pp, dp, ep as given; the ZeRO stage from `data_parallel`: ddp 0, zero1/2/3 1/2/3,
    fsdp2 3 (0 when dp = 1: nothing to shard over). FSDP2 leaves routed experts unsharded over their
    data-parallel group (options.py), so under it they count whole on every rank.
  * The micro-batch the engines run: TrainConfig.micro_batch_size, else a replica's whole batch in one
    pass; a pipeline splits a replica's batch into `ParallelLayout.microbatches` micro-batches. Uneven
    data-parallel shares are priced at the largest. No recomputation: the engines do none.
  * Layers per pipeline rank as the model's plug-in splits them. An interleaved rank holds two stages:
    their layers add up, and its activations are priced as 1F1B's (which keeps fewer micro-batches in
    flight, as does a schedule without `pipeline_run_ahead`).
  * memory.py's activation coefficients count 16-bit values (Korthikanti et al. 2022); they scale by
    `compute_dtype_bytes / 2`, all but the logits the loss holds (fp32 under either precision).
  * DeepSpeed's ZeRO-3 adds its bf16 copy of each weight partition under mixed precision, its
    gradient bucket (DEEPSPEED_REDUCE_BUCKET elements in the compute dtype) and, in its optimizer
    step, the fp32 flat copy of each sub-group's gradient partition (up to DEEPSPEED_SUB_GROUP
    elements; at 494M over 2 ranks it stays resident: 1 GB more after a step than the 16 bytes a
    parameter and the bf16 copies, measured). ZeRO-1/2's buckets are not counted yet.
  * Usable device memory is the device's `memory_gb` x `PlanOptions.usable_memory_fraction`, as the
    planner's. Usable host memory is a node's (`host_memory_gb`, descriptor NodeType.memory_gb) x
    `usable_host_memory_fraction` (the share Ray's memory monitor lets a node fill before it kills
    workers), less `host_memory_reserve_gb` for the processes that are not the job's workers (Ray's
    daemons, the driver, the job's controller).
  * Workers take the graph's devices in node order, ranks first, then an elastic job's spares: the
    order `first_devices` assumes and `fit`'s PACK placement group follows.
  * A node's host memory holds, summed over the workers placed on it:
      - on CPU devices (accelerator "cpu") the device memory *is* host memory: model states,
        activations and the worker process itself (WORKER_PROCESS_BYTES) count against the node; on
        accelerators they do not;
      - an elastic job's snapshots (elastic/snapshot.py): every member keeps `snapshot_copies` copies of
        its pipeline rank's state (weights and Adam's two moments: `dtype_bytes + optimizer_bytes_per_param`
        bytes per parameter): its own 1/dp shards under FSDP2 and ZeRO-3 (in node shared memory,
        elastic/shelf.py), otherwise the whole stage gathered over TP and EP;
      - its replicas (planner/replicas.py): each of `replica_workers` keeps every stage's full state,
        `replica_copies` times.
    Not counted: Ray's object store, the worker processes on accelerator nodes, transient copies (snapshot reads
    in flight, the whole model a plug-in builds on CPU before keeping its stages), DDP's gradient buckets.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from baige_ray.api.errors import LayoutMemoryError
from baige_ray.api.validation import require_choice, require_int
from baige_ray.planner.memory import (
    RECOMPUTE,
    activation_bytes,
    logit_bytes,
    model_state_bytes,
    optimizer_bytes_per_param,
    stage_param_counts,
)
from baige_ray.planner.model_spec import ModelSpec
from baige_ray.planner.options import PlanOptions
from baige_ray.topology.graph import ResourceGraph

if TYPE_CHECKING:
    from baige_ray.api.configs import TrainConfig
    from baige_ray.parallel.layout import ParallelLayout

ZERO_STAGE_OF = {"ddp": 0, "zero1": 1, "zero2": 2, "zero3": 3, "fsdp2": 3}
CPU_DEVICE = "cpu"
# A worker process before it builds anything: Python, torch, transformers, DeepSpeed and Ray's worker
# (0.585 GB resident measured on a Ray actor after those imports, torch 2.13 CPU).
WORKER_PROCESS_BYTES = 0.6e9
# DeepSpeed ZeRO-3's gradient bucket (`reduce_bucket_size`, its default, which the engine keeps): one
# buffer of that many elements in the reduction's dtype, filled whole once the model is larger.
DEEPSPEED_REDUCE_BUCKET = 5e8
# ZeRO-3's optimizer step works on sub-groups of a rank's partition of at most this many elements
# (`sub_group_size`, its default), each with an fp32 flat copy of its gradients.
DEEPSPEED_SUB_GROUP = 1e9


@dataclass(kw_only=True, frozen=True)
class LayoutShape:
    """One explicit layout as the memory model prices it; `stage_layers` has one entry per pipeline rank."""

    name: str
    tp: int = 1
    pp: int = 1
    dp: int = 1
    ep: int = 1
    cp: int = 1  # context-parallel ranks: 1/cp of every sequence each; weights sharded over dp x cp by ZeRO
    zero_stage: int = 0
    micro_batch: int
    num_micro_batches: int = 1
    stage_layers: tuple[int, ...]
    experts_sharded: bool = True  # over their data-parallel group when zero_stage shards anything
    compute_dtype_bytes: int = 2
    sequence_parallel: bool = True  # with tp > 1, where the model offers it (ParallelLayout.sequence_parallel)
    deepspeed: bool = False  # ZeRO by DeepSpeed rather than FSDP2
    # fp32 gradients of the stage held beside the usual one (TrainConfig.world_size_invariant: one per
    # local micro-batch instead of the one they accumulate into, and the int64 sum, the size of two).
    extra_gradient_copies: int = 0
    recompute: str = "none"  # RECOMPUTE: "full" keeps each block's input alone (ParallelLayout.recompute)

    def __post_init__(self) -> None:
        for name in ("tp", "pp", "dp", "ep", "cp", "micro_batch", "num_micro_batches"):
            require_int("LayoutShape", name, getattr(self, name), minimum=1)
        require_choice("LayoutShape", "zero_stage", self.zero_stage, (0, 1, 2, 3))
        require_choice("LayoutShape", "recompute", self.recompute, RECOMPUTE)
        require_choice("LayoutShape", "compute_dtype_bytes", self.compute_dtype_bytes, (1, 2, 4))
        require_int("LayoutShape", "extra_gradient_copies", self.extra_gradient_copies, minimum=0)
        object.__setattr__(self, "stage_layers", tuple(self.stage_layers))
        if len(self.stage_layers) != self.pp:
            raise ValueError(f"LayoutShape.stage_layers={self.stage_layers!r} is invalid: expected pp={self.pp} "
                             "entries, one per pipeline rank")
        if self.dp % self.ep:
            raise ValueError(f"LayoutShape.ep={self.ep} is invalid: expected a divisor of dp={self.dp}")

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.dp * self.cp

    @property
    def ranks_per_stage(self) -> int:
        return self.tp * self.dp * self.cp


@dataclass(kw_only=True, frozen=True)
class HostCopies:
    """Model state an elastic job keeps in host memory beside training; all zero for `fit`."""

    snapshot_copies: int = 0  # of its own pipeline rank's full state, on every member
    replica_workers: tuple[int, ...] = ()  # workers (members by rank, then spares) keeping every stage
    replica_copies: int = 0  # full-model copies each replica worker keeps
    num_spares: int = 0  # idle workers after the members: a device each, no training state

    def __post_init__(self) -> None:
        for name in ("snapshot_copies", "replica_copies", "num_spares"):
            require_int("HostCopies", name, getattr(self, name), minimum=0)
        object.__setattr__(self, "replica_workers", tuple(int(w) for w in self.replica_workers))


@dataclass(kw_only=True, frozen=True)
class LayoutFit:
    """What a fitting layout needs: per pipeline rank (bytes per device) and per node used (host bytes)."""

    state_bytes: tuple[float, ...]
    activation_bytes: tuple[float, ...]
    node_ids: tuple[int, ...]
    host_bytes: tuple[float, ...]
    host_capacity_bytes: tuple[float, ...]

    @property
    def device_bytes(self) -> tuple[float, ...]:
        return tuple(s + a for s, a in zip(self.state_bytes, self.activation_bytes))


def layout_shape(layout: ParallelLayout, train: TrainConfig, stage_layers: Sequence[int], *,
                 compute_dtype_bytes: int) -> LayoutShape:
    """The shape of `layout` training `train`; `stage_layers` per pipeline stage as the engines split them."""
    per_replica = max(layout.replica_batches(train))
    if layout.pp > 1:
        num_micro = layout.microbatches(per_replica)
        micro = per_replica // num_micro
    else:
        micro = train.micro_batch_size or per_replica
        num_micro = per_replica // micro
    per_rank = tuple(sum(stage_layers[s] for s in layout.stage_indices(rank)) for rank in range(layout.pp))
    return LayoutShape(name=layout.describe(), tp=layout.tp, pp=layout.pp, dp=layout.dp, ep=layout.ep, cp=layout.cp,
                       zero_stage=ZERO_STAGE_OF[layout.data_parallel] if layout.gradient_replicas > 1 else 0,
                       micro_batch=micro, num_micro_batches=num_micro, stage_layers=per_rank,
                       experts_sharded=layout.data_parallel != "fsdp2", compute_dtype_bytes=compute_dtype_bytes,
                       sequence_parallel=layout.sequence_parallel, deepspeed=layout.data_parallel.startswith("zero"),
                       extra_gradient_copies=num_micro + 1 if train.world_size_invariant else 0,
                       recompute=layout.recompute)


def device_bytes(model: ModelSpec, shape: LayoutShape) -> tuple[np.ndarray, np.ndarray]:
    """(model states, activations) per device of each pipeline rank, in bytes."""
    layers = np.asarray(shape.stage_layers)
    states = model_state_bytes(model, layers, tp=shape.tp, dp=shape.dp * shape.cp, ep=[shape.ep],
                               zero=[shape.zero_stage])[0]
    if shape.zero_stage == 3 and not shape.experts_sharded and shape.dp > shape.ep:
        _, expert = stage_param_counts(model, layers)
        whole = expert / (shape.tp * shape.ep) * (2 * model.dtype_bytes + optimizer_bytes_per_param(model))
        states = states + whole * (1 - shape.ep / shape.dp)  # what the ZeRO-3 pricing took off
    if shape.deepspeed and shape.zero_stage == 3:
        states = states + _deepspeed_zero3_extra_bytes(model, shape, layers)
    if shape.extra_gradient_copies:  # only without TP, EP or ZeRO (exact_gradients.check_world_size_invariant)
        dense, expert = stage_param_counts(model, layers)
        states = states + shape.extra_gradient_copies * model.dtype_bytes * (dense + expert)
    activations = activation_bytes(model, layers, tp=shape.tp, pp=shape.pp, micro_batch=[shape.micro_batch],
                                   recompute=[RECOMPUTE.index(shape.recompute)],
                                   num_micro_batches=[shape.num_micro_batches],
                                   sequence_parallel=shape.sequence_parallel, cp=shape.cp)[0]
    # in fp32 for the loss whatever the compute; a context-parallel rank's for its tokens
    logits = logit_bytes(model, shape.pp)[0] * shape.micro_batch / shape.cp
    return states, (activations - logits) * (shape.compute_dtype_bytes / 2) + logits


def _deepspeed_zero3_extra_bytes(model: ModelSpec, shape: LayoutShape, layers: np.ndarray) -> np.ndarray:
    """What DeepSpeed's ZeRO-3 holds beyond the 16 bytes a parameter: under mixed precision its
    low-precision copy of each weight partition beside the fp32 master, its gradient bucket, and the
    fp32 copy of a sub-group's gradient partition its optimizer step makes."""
    dense, expert = stage_param_counts(model, layers)
    params = (dense + expert) / shape.tp
    low_precision_copy = shape.compute_dtype_bytes * params / shape.dp if shape.compute_dtype_bytes < 4 else 0.0
    fp32_gradient_copy = 4 * np.minimum(DEEPSPEED_SUB_GROUP, params / shape.dp)
    return low_precision_copy + shape.compute_dtype_bytes * np.minimum(DEEPSPEED_REDUCE_BUCKET, params) + fp32_gradient_copy


def stage_state_bytes(model: ModelSpec, shape: LayoutShape) -> np.ndarray:
    """Each pipeline rank's whole state (weights and Adam moments, every shard gathered), in bytes."""
    dense, expert = stage_param_counts(model, np.asarray(shape.stage_layers))
    return (dense + expert) * (model.dtype_bytes + optimizer_bytes_per_param(model))


def snapshot_bytes(model: ModelSpec, shape: LayoutShape) -> np.ndarray:
    """One snapshot of each pipeline rank, in bytes: a rank's own shards where ZeRO-3/FSDP2 shard the state
    (parallel/shards.py, as ParallelLayout.snapshots_are_sharded says), else the whole stage."""
    sharded = shape.zero_stage == 3 and shape.dp * shape.cp > 1 and shape.ep == 1
    whole = stage_state_bytes(model, shape)
    return whole / (shape.dp * shape.cp) if sharded else whole


def worker_positions(graph: ResourceGraph, num_workers: int) -> np.ndarray:
    """Graph rows of the workers: the first `num_workers` devices in node order."""
    if graph.num_devices < num_workers:
        raise ValueError(f"num_workers={num_workers} is invalid: the graph {graph.name!r} has "
                         f"{graph.num_devices} devices")
    return np.arange(num_workers)


def check_fits(model: ModelSpec, graph: ResourceGraph, shape: LayoutShape, *, copies: HostCopies | None = None,
               options: PlanOptions | None = None) -> LayoutFit:
    """What `shape` needs on `graph`'s first devices; LayoutMemoryError naming the budget it exceeds."""
    copies = copies or HostCopies()
    options = options or PlanOptions()
    rows = worker_positions(graph, shape.world_size + copies.num_spares)
    states, activations = device_bytes(model, shape)
    _check_devices(model, graph, shape, (states, activations), options.usable_memory_fraction)
    node_ids, needed, capacity = _check_hosts(model, graph, shape, copies, rows, states + activations, options)
    return LayoutFit(state_bytes=tuple(float(b) for b in states), activation_bytes=tuple(float(b) for b in activations),
                     node_ids=tuple(int(n) for n in node_ids), host_bytes=tuple(float(b) for b in needed),
                     host_capacity_bytes=tuple(float(b) for b in capacity))


def _check_devices(model: ModelSpec, graph: ResourceGraph, shape: LayoutShape,
                   parts: tuple[np.ndarray, np.ndarray], fraction: float) -> None:
    """Ranks are Megatron-ordered (stage major) on the graph's first devices."""
    members = np.arange(shape.world_size)
    needed = sum(parts)[members // shape.ranks_per_stage]
    usable = graph.devices.memory_gb[members].astype(np.float64) * 1e9 * fraction
    worst = int(np.argmax(needed / usable))
    if needed[worst] <= usable[worst]:
        return
    stage = worst // shape.ranks_per_stage
    states, activations = (float(part[stage]) for part in parts)
    where = f" on pipeline rank {stage}" if shape.pp > 1 else ""
    chip = graph.profiles[int(graph.devices.profile[members[worst]])].chip_model
    total = float(graph.devices.memory_gb[members[worst]])
    raise LayoutMemoryError(
        f"{shape.name} of {model.name} needs {_gb(needed[worst])} GB per device{where} (weights+grads+Adam "
        f"{_gb(states)}, activations {_gb(activations)}); {chip} has {_gb(usable[worst])} GB usable "
        f"({fraction:.0%} of {_gb(total * 1e9)} GB)",
        needed_gb=float(needed[worst]) / 1e9, available_gb=float(usable[worst]) / 1e9, layout=shape.name,
        budget="device memory")


def _host_bytes_per_worker(model: ModelSpec, graph: ResourceGraph, shape: LayoutShape, copies: HostCopies,
                           rows: np.ndarray, stage_device_bytes: np.ndarray) -> dict[str, np.ndarray]:
    """Host bytes of every worker (members by rank, then spares), by what holds them."""
    world = shape.world_size
    on_cpu = np.array([graph.profiles[int(p)].accelerator == CPU_DEVICE for p in graph.devices.profile[rows]])
    stage = rows[:world] // shape.ranks_per_stage
    training = np.zeros(len(rows))
    training[:world] = np.where(on_cpu[:world], stage_device_bytes[stage] + WORKER_PROCESS_BYTES, 0.0)
    snapshot = snapshot_bytes(model, shape)
    snapshots = np.zeros(len(rows))
    snapshots[:world] = copies.snapshot_copies * snapshot[stage]
    replicas = np.zeros(len(rows))
    for worker in copies.replica_workers:
        if not 0 <= worker < len(rows):
            raise ValueError(f"HostCopies.replica_workers={copies.replica_workers!r} is invalid: expected "
                             f"indices below {len(rows)} (members, then spares)")
        replicas[worker] += copies.replica_copies * stage_state_bytes(model, shape).sum()
    return {"training": training, "snapshots": snapshots, "replicas": replicas}


def _check_hosts(model: ModelSpec, graph: ResourceGraph, shape: LayoutShape, copies: HostCopies, rows: np.ndarray,
                 stage_device_bytes: np.ndarray, options: PlanOptions) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(node ids, host bytes needed, usable host bytes) of every node holding a worker."""
    host = _host_bytes_per_worker(model, graph, shape, copies, rows, stage_device_bytes)
    node_ids, index = np.unique(graph.devices.node[rows], return_inverse=True)
    per_node = {part: np.bincount(index, weights=values, minlength=len(node_ids)) for part, values in host.items()}
    needed = sum(per_node.values())
    total = np.array([graph.profile_of_node(int(node)).host_memory_gb * 1e9 for node in node_ids])
    capacity = np.maximum(total * options.usable_host_memory_fraction - options.host_memory_reserve_gb * 1e9, 0.0)
    worst = int(np.argmax(needed - capacity))
    if needed[worst] > capacity[worst]:
        workers = int(np.bincount(index, minlength=len(node_ids))[worst])
        raise _host_error(model, graph, shape, copies, int(node_ids[worst]), workers,
                          {part: float(values[worst]) for part, values in per_node.items()},
                          (float(total[worst]), float(capacity[worst])), options)
    return node_ids, needed, capacity


def _host_error(model: ModelSpec, graph: ResourceGraph, shape: LayoutShape, copies: HostCopies, node: int,
                num_workers: int, parts: dict[str, float], total_and_usable: tuple[float, float],
                options: PlanOptions) -> LayoutMemoryError:
    total, capacity = total_and_usable
    needed = sum(parts.values())
    held = []
    if parts["training"]:
        held.append(f"workers on cpu devices (process, model states, activations) {_gb(parts['training'])}")
    if parts["snapshots"]:
        held.append(f"snapshots {_gb(parts['snapshots'])} ({copies.snapshot_copies} per worker)")
    if parts["replicas"]:
        held.append(f"replicas {_gb(parts['replicas'])}")
    profile = graph.profile_of_node(node)
    return LayoutMemoryError(
        f"{shape.name} of {model.name} needs {_gb(needed)} GB of host memory on node {node} ({profile.name}, "
        f"{num_workers} workers: {', '.join(held)}); the node has {_gb(capacity)} GB usable "
        f"({options.usable_host_memory_fraction:.0%} of {_gb(total)} GB, the share Ray lets it fill, less "
        f"{options.host_memory_reserve_gb:g} GB for Ray's own processes, the driver and the controller)",
        needed_gb=needed / 1e9, available_gb=capacity / 1e9, layout=shape.name, budget=f"host memory of node {node}")


def _gb(num_bytes: float) -> str:
    """GB with one decimal, or two significant digits below 1 GB (small simulated chips)."""
    gb = float(num_bytes) / 1e9
    return f"{gb:.1f}" if gb >= 1 or gb == 0 else f"{gb:.2g}"
