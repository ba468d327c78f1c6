"""`calibrate(...)`: measure the cluster at hand through its worker actors, once, and keep it (runtime/calibration_store.py).

The planner prices with what this measures (planner/calibration.py) instead of nominal
constants. A calibration is kept as JSON per graph fingerprint (constants.calibration_dir);
the next call on the same hardware reuses it and measures only what it lacks (the compute
curves of a model shape it has not seen).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from baige_ray.api.configs import ScalingConfig
from baige_ray.planner.calibration import (
    COLLECTIVES,
    Calibration,
    ChipCalibration,
    CollectiveSample,
    ComputeCurve,
    ShardingCost,
    fit_link,
    graph_fingerprint,
    shape_key,
    sharding_key,
)
from baige_ray.planner.links import probe_groups, tier_pairs
from baige_ray.planner.model_spec import ModelSpec
from baige_ray.runtime.calibration_store import load_calibration, save_calibration
from baige_ray.topology.graph import ResourceGraph

# The layer the host-sharing probe runs: any compute-bound shape will do.
CALIBRATION_LAYER = ModelSpec(name="probe", num_layers=1, hidden=256, ffn_hidden=1024, num_heads=8, seq_len=128,
                              vocab_size=256, global_batch=2, dtype_bytes=4)
MESSAGE_SIZES = (64 * 1024, 1024 * 1024, 4 * 1024 * 1024)
MICRO_BATCHES = (1, 2, 8)
REPEATS = 3


@dataclasses.dataclass(kw_only=True, frozen=True)
class CalibrationRequest:
    """What to measure: link tiers, overlap and optimizer always; compute for these models' shapes
    at these TP degrees (None: every degree the heads allow inside a node) and micro-batch sizes.
    `model_configs` maps a model's name (ModelSpec.name) to its config (GPTConfig, HFModel, ...):
    the compute probes then time the model's own layers, not a generic layer of its shapes."""

    models: tuple[ModelSpec, ...] = ()
    model_configs: dict[str, Any] = dataclasses.field(default_factory=dict)
    tps: tuple[int, ...] | None = None
    micro_batches: tuple[int, ...] = MICRO_BATCHES
    message_sizes: tuple[int, ...] = MESSAGE_SIZES
    repeats: int = REPEATS
    iterations: int = 4  # (compute, collective) rounds per loaded collective timing
    compute_window_s: float = 0.25  # seconds each compute shape runs on every device at once
    # Per device: micro-batches whose probe would hold more are not measured (the curve holds its ends).
    # None: 1 GiB where the devices are host CPUs sharing its memory, a quarter of the smallest
    # accelerator's memory on GPUs (Qwen2.5-0.5B's head alone holds 1.9 GB a 1,024-token sequence).
    probe_memory_bytes: float | None = None

    def probe_memory_limit(self, accelerated: bool, device_memory_gb: float) -> float:
        if self.probe_memory_bytes is not None:
            return self.probe_memory_bytes
        return device_memory_gb * 1e9 / 4 if accelerated else float(1 << 30)

    def __post_init__(self) -> None:
        unknown = sorted(set(self.model_configs) - {model.name for model in self.models})
        if unknown:
            raise ValueError(f"CalibrationRequest.model_configs={unknown} is invalid: expected names of "
                             f"CalibrationRequest.models {[model.name for model in self.models]}")

    def tp_degrees(self, model: ModelSpec, devices_per_node: int, num_devices: int) -> list[int]:
        """TP degrees the probe can run: inside a node, dividing the heads, FFN and vocabulary, and the
        device count (every device runs in some TP group at once)."""
        allowed = [t for t in range(1, devices_per_node + 1) if model.num_heads % t == 0 and model.kv_heads % t == 0
                   and num_devices % t == 0
                   and model.ffn_hidden % t == 0 and model.vocab_size % t == 0]
        return [t for t in allowed if self.tps is None or t in self.tps]


def zero_stages_measured(tp: int) -> tuple[int, ...]:
    """The ZeRO stages whose engine cost calibration measures at TP degree `tp`: without TP the engines run
    ZeRO-1/2/3 on DeepSpeed, beside TP only ZeRO-3, on FSDP2 (auto_plan.layout_from_plan)."""
    return (1, 2, 3) if tp == 1 else (3,)


def sharding_engine(tp: int, num_devices: int) -> str | None:
    """The engine whose ZeRO cost calibration measures at TP degree `tp` over every device outside the TP
    group (auto_plan.layout_from_plan): DeepSpeed without TP, FSDP2 beside it; None without such devices."""
    if num_devices // tp <= 1:
        return None
    return "deepspeed" if tp == 1 else "fsdp2"


def missing_compute(calibration: Calibration | None, graph: ResourceGraph,
                    request: CalibrationRequest) -> list[tuple[ModelSpec, int]]:
    """(model, tp) pairs whose curves the calibration lacks for some chip of the graph."""
    per_node = int(np.bincount(graph.devices.node).max()) if graph.num_devices else 1
    peaks = {p.peak_tflops * 1e12 for p in graph.profiles}
    return [(model, tp) for model in request.models for tp in request.tp_degrees(model, per_node, graph.num_devices)
            if calibration is None or not calibration.has_compute(model, [tp], peaks)
            or (graph.num_devices > tp and any(calibration.sharding_seconds(
                model, tp, graph.num_devices // tp, peaks, [model.seq_len], stage) is None
                for stage in zero_stages_measured(tp)))]


def calibrate(graph: ResourceGraph, request: CalibrationRequest | None = None, *, directory: str | Path | None = None,
              refresh: bool = False, scaling: ScalingConfig | None = None,
              progress: Callable[[str, int, int], None] | None = None) -> Calibration:
    """The calibration of `graph`'s hardware, measured where it lacks something `request` asks for.
    Starts one worker actor per device of `graph` on the connected Ray cluster when it measures."""
    request = request or CalibrationRequest()
    kept = None if refresh else load_calibration(graph, directory)
    todo = missing_compute(kept, graph, request)
    if kept is not None and _has_fabric(kept, graph) and not todo:
        return kept
    calibration = kept or Calibration(fingerprint=graph_fingerprint(graph), backend="")
    scaling = scaling or ScalingConfig(num_workers=graph.num_devices)
    with _ProbeGroup(graph, dataclasses.replace(scaling, num_workers=graph.num_devices)) as group:
        calibration.backend = group.backend
        # Summed over the calls that built this calibration, like its measured phases.
        seconds = calibration.seconds
        seconds["starting the workers"] = seconds.get("starting the workers", 0.0) + group.start_s
        seconds["loading libraries"] = seconds.get("loading libraries", 0.0) + _load_libraries(group, request, todo)
        if not _has_fabric(calibration, graph):
            _measure_fabric(group, calibration, request, progress)
        for index, (model, tp) in enumerate(todo):
            if progress is not None:
                progress(f"compute {model.name} tp={tp}", index, len(todo))
            _measure_compute(group, calibration, model, tp, request)
    save_calibration(calibration, directory)
    return calibration


def _load_libraries(group: _ProbeGroup, request: CalibrationRequest, todo: list[tuple[ModelSpec, int]]) -> float:
    """Seconds the workers take to import what the probes of `todo` use (runtime/calibration_probes.py's
    `library_probe`), so that each probe's seconds are its measuring."""
    started = time.perf_counter()
    own_layers = {model.name: request.model_configs[model.name] for model, _ in todo
                  if model.name in request.model_configs and not model.is_moe}  # what `_probe_layers` builds
    group.run("libraries", sources=list(own_layers.values()), tensor_parallel=any(tp > 1 for _, tp in todo),
              deepspeed=any(sharding_engine(tp, len(group.positions)) == "deepspeed" for _, tp in todo))
    return time.perf_counter() - started


def _has_fabric(calibration: Calibration, graph: ResourceGraph) -> bool:
    """Whether the links, overlap and host sharing are measured (a single device has no links to measure)."""
    return calibration.host_sharing is not None and (bool(calibration.links) or graph.num_devices == 1)


class _ProbeGroup:
    """Worker actors on every device of the graph, in one process group, each rank's graph row known."""

    def __init__(self, graph: ResourceGraph, scaling: ScalingConfig):
        self.graph, self.scaling = graph, scaling
        self.start_s = 0.0  # seconds the actors took to start and form their process group

    def __enter__(self) -> _ProbeGroup:
        from baige_ray.jobs.worker_group import WorkerGroup

        started = time.perf_counter()
        self.group = WorkerGroup(self.scaling, timeout_s=600.0)
        self.group.form_process_group()
        self.positions = _rank_positions(self.graph, self.group.device_infos)
        self.backend = "nccl" if self.group.device_infos[0].device_kind == "cuda" else "gloo"
        self.start_s = time.perf_counter() - started
        return self

    def __exit__(self, *exc) -> None:
        self.group.shutdown()

    def run(self, name: str, **kwargs) -> list:
        return self.group.call("calibration_probe", name, kwargs)


def _rank_positions(graph: ResourceGraph, infos) -> np.ndarray:
    """Each rank's row in the graph, from the Ray node it runs on and its device index there;
    rank order (workers are sorted by node and device) where the graph does not name Ray nodes."""
    by_name = {name: int(node) for name, node in zip(graph.nodes.names, graph.nodes.node_id)}
    try:
        rows = [graph.positions([graph.devices_of_node(by_name[info.node_id])[info.device_index]])[0]
                for info in infos]
    except (KeyError, IndexError):
        return np.arange(len(infos))
    return np.asarray(rows) if len(set(rows)) == len(rows) else np.arange(len(infos))


def _measure_fabric(group: _ProbeGroup, calibration: Calibration, request: CalibrationRequest, progress) -> None:
    started = time.perf_counter()
    partitions = _tier_partitions(group.graph, group.positions)
    if progress is not None:
        progress("links", 0, 3)
    results = group.run("loaded_collectives", partitions=[groups for _, groups in partitions], kinds=list(COLLECTIVES),
                        sizes=list(request.message_sizes), iterations=request.iterations, work_s=0.004)
    timings: dict[tuple, list[float]] = {}
    for sample in (s for per_rank in results for s in per_rank):
        timings.setdefault((sample["partition"], sample["kind"], sample["size_bytes"]), []).append(sample["seconds"])
    samples: dict[int, list[CollectiveSample]] = {}
    for (index, kind, size), seconds in sorted(timings.items()):
        tier, groups = partitions[index]
        members = 2 if kind == "send_recv" else len(groups[0])
        samples.setdefault(tier, []).append(CollectiveSample(tier=tier, kind=kind, group_size=members,
                                                             size_bytes=size, seconds=float(np.median(seconds))))
    calibration.links = {tier: fit_link(found) for tier, found in samples.items()}
    calibration.samples = [dataclasses.asdict(s) for found in samples.values() for s in found]
    calibration.seconds["links"] = time.perf_counter() - started
    if progress is not None:
        progress("overlap", 1, 3)
    started = time.perf_counter()
    # The median over repeats and ranks: one window's share swung from 0.05 to 0.7 on a 2-core host.
    calibration.overlap = float(np.median([group.run("overlap", size_bytes=request.message_sizes[-1],
                                                     window_s=request.compute_window_s)
                                           for _ in range(request.repeats)]))
    optimizer = group.run("optimizer", num_params=1 << 20, repeats=request.repeats)
    calibration.optimizer_s_per_param = float(np.median([o["optimizer_s_per_param"] for o in optimizer]))
    # A step's fixed cost: its bookkeeping, and one synchronization of ranks that drifted apart computing.
    synchronization = group.run("synchronization", spec=dataclasses.asdict(CALIBRATION_LAYER), micro_batch=2,
                                window_s=request.compute_window_s)
    calibration.step_overhead_s = float(np.median([o["step_overhead_s"] for o in optimizer])
                                        + np.median(synchronization))
    calibration.seconds["overlap_and_optimizer"] = time.perf_counter() - started
    started = time.perf_counter()
    calibration.host_sharing, calibration.host_sharing_measured_at = _host_sharing(group, request)
    calibration.seconds["host_sharing"] = time.perf_counter() - started


def _host_sharing(group: _ProbeGroup, request: CalibrationRequest) -> tuple[float, float]:
    """How much faster one device of a host computes while the host's other devices idle, and the share
    of devices busy then (one per host)."""
    spec = dataclasses.asdict(CALIBRATION_LAYER)
    everyone = list(range(len(group.positions)))
    hosts = [info.hostname for info in group.group.device_infos]
    first_of_host = sorted({hosts.index(host) for host in hosts})
    if len(first_of_host) == len(everyone):  # every device alone on its host: nothing shares it
        return 1.0, 1.0
    busy = group.run("host_sharing", spec=spec, micro_batch=2, window_s=request.compute_window_s, active=everyone)
    alone = group.run("host_sharing", spec=spec, micro_batch=2, window_s=request.compute_window_s,
                      active=first_of_host)
    return (max(1.0, float(np.median([busy[r] / alone[r] for r in first_of_host]))),
            len(first_of_host) / len(everyone))


def _tier_partitions(graph: ResourceGraph, positions: np.ndarray) -> list[tuple[int, list[list[int]]]]:
    """Per link tier: every disjoint pair at that tier at once, and the tier's largest group."""
    partitions = []
    for tier, groups in probe_groups(graph, positions).items():
        pairs = tier_pairs(graph, positions, tier)
        if pairs:
            partitions.append((tier, pairs))
        if len(groups[-1]) > 2:
            partitions.append((tier, [groups[-1]]))
    return partitions


def _measure_compute(group: _ProbeGroup, calibration: Calibration, model: ModelSpec, tp: int,
                     request: CalibrationRequest) -> None:
    started = time.perf_counter()
    limit = request.probe_memory_limit(group.backend == "nccl", min(p.device_memory_gb for p in group.graph.profiles))
    batches = sorted({b for b in request.micro_batches if b <= model.global_batch
                      and probe_bytes(model, tp, b) <= limit}) or [1]
    source = request.model_configs.get(model.name)
    results = group.run("compute", spec=dataclasses.asdict(model), tp=tp, micro_batches=batches,
                        window_s=request.compute_window_s, source=source)
    dp = len(group.positions) // tp
    sharded = None
    engine = sharding_engine(tp, len(group.positions))
    if engine is not None:
        # The engines run ZeRO without pipelines, so a micro-batch is at most a replica's share of the batch:
        # the largest such is timed, in rounds. What sharding adds is mostly the weights' and gradients'
        # traffic, which does not grow with the micro-batch: one shape timed three times prices it better
        # than two shapes timed once each, at about the same cost.
        sharded_batch = max([b for b in batches if b <= max(1, model.global_batch // dp)] or batches[:1])
        sharded = group.run("sharded_layer", spec=dataclasses.asdict(model), tp=tp, micro_batches=[sharded_batch],
                            window_s=request.compute_window_s, engine=engine,
                            source=source, zero_stages=zero_stages_measured(tp))
    profile_of_rank = group.graph.devices.profile[group.positions]
    key = shape_key(model, tp)
    for profile_index in np.unique(profile_of_rank):
        profile = group.graph.profiles[int(profile_index)]
        mine = [r for r, p in zip(results, profile_of_rank) if p == profile_index]
        chip = calibration.chips.setdefault(profile.chip_model, ChipCalibration(
            chip=profile.chip_model, peak_flops=profile.peak_tflops * 1e12))
        tokens = tuple(mine[0]["tokens"])
        # The mean over devices: with shared cores, one device's luck is another's loss.
        chip.layer[key] = ComputeCurve(tokens=tokens, flops_per_s=tuple(np.mean([r["layer"] for r in mine], axis=0)))
        chip.head[key] = ComputeCurve(tokens=tokens, flops_per_s=tuple(np.mean([r["head"] for r in mine], axis=0)))
        chip.optimizer_s[key] = tuple(float(v) for v in np.mean([r["optimizer_s"] for r in mine], axis=0))
        if sharded is not None:
            for stage in zero_stages_measured(tp):
                extra = [np.subtract(z["layer_s"][stage], r["layer_s"][batches.index(sharded_batch)])
                         for z, r, p in zip(sharded, results, profile_of_rank) if p == profile_index]
                # A difference of two timings can come out below zero (-7 ms once, 8 ranks on 2 cores);
                # sharding never makes a layer faster.
                chip.sharding[sharding_key(model, tp, dp, stage)] = ShardingCost(
                    tokens=tuple(sharded[0]["tokens"]),
                    extra_s=tuple(max(0.0, float(v)) for v in np.mean(extra, axis=0)))
        if tp > 1:
            chip.tp_tier[key] = _tensor_parallel_tier(group, tp)
    calibration.seconds[f"compute {key}"] = time.perf_counter() - started


def probe_bytes(model: ModelSpec, tp: int, micro_batch: int) -> float:
    """About what the compute probe holds at once: the head's logits with their fp32 copy, softmax and
    gradient (12 bytes each, as planner/memory.py counts them), and a layer's activations."""
    tokens = micro_batch * model.seq_len
    return tokens * (12.0 * model.vocab_size + 20.0 * model.dtype_bytes * (model.hidden + model.ffn_hidden / tp))


def _tensor_parallel_tier(group: _ProbeGroup, tp: int) -> int:
    """The slowest tier the probe's TP groups (consecutive ranks) spanned."""
    from baige_ray.planner.links import LinkTables, group_link

    groups = group.positions.reshape(-1, tp)
    return group_link(LinkTables(group.graph), groups).tier

