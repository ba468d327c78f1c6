"""The worker actors: one per accelerator (or per CPU slot when there is none).

Plain classes so they can be unit-tested in-process; the Ray layer wraps them with
`ray.remote` and places one instance per placement-group bundle. `WorkerActor` (what `fit`
runs) reports its device, joins and leaves process-group generations without restarting its
process, and runs training steps; `ElasticWorkerActor` (what `launch` runs) adds heartbeats,
step aborts, in-memory snapshots and replicas, answered on threads of their own.
"""

from __future__ import annotations

import collections
import concurrent.futures
import datetime
import gc
import os
import shutil
import socket
import sys
import time
import traceback
from pathlib import Path

import ray
import torch
import torch.distributed as dist

from baige_ray.accelerator import AcceleratorSpec, DeviceProbe, detect_accelerator
from baige_ray.api.device import DeviceInfo
from baige_ray.checkpoint.sharded import write_rank_part
from baige_ray.elastic.faults import Fault, carry_out
from baige_ray.elastic.liveness import LivenessConnection
from baige_ray.elastic.part_clock import PartClock
from baige_ray.elastic.shelf import (
    ShelfReader,
    ShelfRef,
    SnapshotShelf,
    read_shelf,
    run_shelves,
    shelf_directory,
)
from baige_ray.elastic.snapshot import HostSnapshotter
from baige_ray.engines.base import Engine
from baige_ray.engines.factory import build_engine
from baige_ray.engines.host_allocator import return_freed_memory
from baige_ray.engines.preload import preload
from baige_ray.engines.train_job import TrainJob
from baige_ray.failpoints import disarm_fail_points
from baige_ray.parallel.distributed import (
    STEP_ABORT,
    GroupMembership,
    ProcessGroupMember,
    StoreAddress,
    abort_step,
    all_reduce_abortable,
)
from baige_ray.parallel.layout import ParallelLayout
from baige_ray.parallel.shards import ShardedPart, assemble, assemble_lazily
from baige_ray.parallel.state import CanonicalState
from baige_ray.planner.replicas import stages_behind

# An elastic worker runs everything that touches torch.distributed on one thread: DTensor keeps
# thread-local caches that a new generation must clear (see parallel/distributed.py). Heartbeats and
# snapshot reads run on a separate "control" thread so they answer while a step runs, and replica
# copies on a "replica" thread so a slow copy delays neither. `fit`'s workers need none of that and
# stay single-threaded actors: in a threaded one, Ray's main thread wakes every 10 ms to check for
# signals, which took 2% off the steps of 4 workers sharing 2 cores (bench overhead).
ELASTIC_WORKER_THREADS = {"max_concurrency": 1, "concurrency_groups": {"control": 1, "replica": 1, "persist": 1}}
REPLICA_REREAD_PAUSE_S = 0.02  # how often a replica copy re-reads the stages behind the others


def _ray_placement() -> tuple[str, str, str, list[str]]:
    """Node id, node IP and the Ray resource ids this process holds (empty outside Ray)."""
    import ray

    if not ray.is_initialized():
        return "local", "127.0.0.1", "CPU", []
    context = ray.get_runtime_context()
    accelerator_ids = context.get_accelerator_ids()
    for resource in ("GPU", "NPU"):
        if accelerator_ids.get(resource):
            return context.get_node_id(), ray.util.get_node_ip_address(), resource, accelerator_ids[resource]
    return context.get_node_id(), ray.util.get_node_ip_address(), "CPU", []


def _device_memory(accelerator: AcceleratorSpec) -> tuple[str, int]:
    if accelerator.torch_device_type == "cuda":
        props = torch.cuda.get_device_properties(0)
        return props.name, props.total_memory
    if accelerator.is_accelerator:
        module = getattr(torch, accelerator.torch_device_type)
        return module.get_device_name(0), module.get_device_properties(0).total_memory
    return "cpu", os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def granted_cpu_threads() -> int:
    """One intra-op thread per whole CPU Ray granted this actor, as Ray Train sets OMP_NUM_THREADS: a worker
    given both cores of a host computes on both, while simulated workers granted half a CPU each take one
    thread each instead of thrashing the few cores they share. One outside Ray."""
    if not ray.is_initialized():
        return 1
    return max(1, int(ray.get_runtime_context().get_assigned_resources().get("CPU", 1)))


class WorkerActor:
    """State of one worker process: its device, its process-group membership, its engine."""

    def __init__(self, *, num_threads: int | None = None, probe: DeviceProbe | None = None, cpu_niceness: int = 0):
        """`num_threads`: torch's intra-op threads; None: one per whole CPU Ray granted the actor (at least one)."""
        torch.set_num_threads(num_threads or granted_cpu_threads())
        if cpu_niceness:
            os.nice(cpu_niceness)
        self.accelerator = detect_accelerator(probe)
        self.group = ProcessGroupMember(self.accelerator.process_group_backend)
        self.engine: Engine | None = None
        self.current_step: int | None = None
        self._last_step_end: float | None = None  # perf_counter at the end of this engine's latest step

    def device_info(self) -> DeviceInfo:
        node_id, node_ip, resource, resource_ids = _ray_placement()
        name, memory = _device_memory(self.accelerator)
        return DeviceInfo(
            node_id=node_id,
            node_ip=node_ip,
            hostname=socket.gethostname(),
            pid=os.getpid(),
            device_kind=self.accelerator.kind.value,
            device_index=int(resource_ids[0]) if resource_ids else 0,
            device_name=name,
            memory_bytes=memory,
            ray_resource=resource,
            # Holding an accelerator resource while computing on CPU is the simulation mode.
            simulated=resource != "CPU" and not self.accelerator.is_accelerator,
        )

    def ping(self) -> int:
        return os.getpid()

    def host_store(self, host: str | None = None) -> StoreAddress:
        return self.group.host_store(host or _ray_placement()[1])

    def join_group(self, membership: GroupMembership) -> int:
        self._drop_engine()  # an engine holds the old generation's communicators
        self.group.join(membership, abandoned=lambda: self._generation_abandoned(membership.generation))
        return os.getpid()

    def _generation_abandoned(self, generation: int) -> bool:
        return False  # only the elastic controller gives generations up

    def leave_group(self) -> None:
        self._drop_engine()
        self.group.leave()

    def _drop_engine(self) -> None:
        self.engine = None
        self._last_step_end = None

    def all_reduce(self, values: list[float]) -> list[float]:
        """Sum `values` over the current group: a collective health check."""
        tensor = torch.tensor(values, dtype=torch.float64, device=self._device())
        dist.all_reduce(tensor)
        return tensor.cpu().tolist()

    def calibration_probe(self, name: str, kwargs: dict):
        """Run one of runtime/calibration_probes.py's probes with every rank of the current group."""
        from baige_ray.runtime import calibration_probes

        self._require_membership()
        probes = {"compute": calibration_probes.compute_probe,
                  "sharded_layer": calibration_probes.sharded_layer_probe,
                  "loaded_collectives": calibration_probes.loaded_collective_probe,
                  "host_sharing": calibration_probes.host_sharing_probe,
                  "overlap": calibration_probes.overlap_probe, "optimizer": calibration_probes.optimizer_probe,
                  "libraries": calibration_probes.library_probe,
                  "synchronization": calibration_probes.synchronization_probe}
        return probes[name](**kwargs, device=self._device())

    def build_engine(self, job: TrainJob, layout: ParallelLayout, emulated_speed: float = 1.0) -> dict:
        membership = self._require_membership()
        if layout.world_size != membership.world_size:
            raise ValueError(
                f"layout {layout.describe()} needs {layout.world_size} ranks; this group has {membership.world_size}"
            )
        self.engine = build_engine(
            job, layout, membership.rank, device=self._device(), emulated_speed=emulated_speed
        )
        return_freed_memory()
        return {
            "num_parameters": sum(p.numel() for p in self.engine.parameters),
            "data": self.engine.data.fingerprint if self.engine.data else None,
        }

    def train_step(self, step: int) -> dict:
        return self._require_engine().train_step(step)

    def train_steps(self, start: int, count: int) -> list[dict]:
        """Steps [start, start + count) back to back, one round trip for all of them.

        Each step's metrics carry `rank_step_s`: its wall time on this rank, from the end of this
        engine's step before (so the hand-over between two calls counts) or, for the engine's first
        step, from the start of this call.
        """
        previous_end = self._last_step_end if self._last_step_end is not None else time.perf_counter()
        steps = []
        for step in range(start, start + count):
            self.current_step = step
            metrics = self.train_step(step)
            self._last_step_end = time.perf_counter()
            metrics["rank_step_s"] = self._last_step_end - previous_end
            previous_end = self._last_step_end
            steps.append(metrics)
        return steps

    def export_state(self) -> CanonicalState:
        return self._require_engine().export_state()

    def export_weights(self) -> dict[str, torch.Tensor]:
        return self._require_engine().export_weights()

    def import_state(self, state: CanonicalState) -> None:
        self._require_engine().import_state(state)

    def _require_engine(self) -> Engine:
        if self.engine is None:
            raise RuntimeError("build_engine has not been called in this process-group generation")
        return self.engine

    def _device(self) -> str:
        return self.accelerator.torch_device(0)

    def _require_membership(self) -> GroupMembership:
        if self.group.membership is None:
            raise RuntimeError("this worker has not joined a process group")
        return self.group.membership


class StepFailed(RuntimeError):
    """A step that raised, with its traceback as text (the original's frames are let go)."""


class ElasticWorkerActor(WorkerActor):
    """A worker under the elastic controller: heartbeats, step aborts and snapshot reads answered on a
    "control" thread while a step runs, replica copies on a "replica" thread (ELASTIC_WORKER_THREADS)."""

    def __init__(self, *, num_threads: int | None = None, probe: DeviceProbe | None = None, cpu_niceness: int = 0,
                 snapshot_slots: int = 2):
        super().__init__(num_threads=num_threads, probe=probe, cpu_niceness=cpu_niceness)
        self.snapshots: HostSnapshotter | None = None
        self.snapshot_slots = snapshot_slots
        self._shelf: SnapshotShelf | None = None
        self._shelves = ShelfReader()  # this node's shelves, for workers elsewhere
        self._collective_timeout_s: float | None = None
        self._failed_generation: int | None = None
        self._abandoned_generation = -1
        self.replica: tuple[int, CanonicalState] | None = None  # every stage at one step, for a lost node
        # A restarted controller reads the steps finished while it was down from here.
        self._recent_metrics: collections.deque[dict] = collections.deque(maxlen=16)
        self._persisting: dict[int, concurrent.futures.Future] = {}  # step -> this rank's checkpoint files
        self._liveness = LivenessConnection()

    @ray.method(concurrency_group="control")
    def connect_liveness(self, address: tuple[str, int], name: str) -> bool:
        """Hold a connection to the controller at `address`, which the kernel closes when this process
        ends: the controller sees a SIGKILL at once (elastic/liveness.py)."""
        return self._liveness.connect(address, name)

    @ray.method(concurrency_group="control")
    def heartbeat(self) -> dict:
        """Answered on its own thread, so it works while a step runs; a frozen process answers nothing."""
        return {"pid": os.getpid(), "step": self.current_step, "time": time.time()}

    def join_group(self, membership: GroupMembership) -> int:
        self._collective_timeout_s = None
        STEP_ABORT.clear()  # an abort ends a generation: only a new one clears it
        return super().join_group(membership)

    def _generation_abandoned(self, generation: int) -> bool:
        return self._abandoned_generation >= generation

    @ray.method(concurrency_group="control")
    def abandon_generation(self, generation: int) -> None:
        """The controller gave up `generation` (a member died while regrouping): stop waiting to join it,
        so the next regroup does not queue behind a rendezvous that can never complete."""
        self._abandoned_generation = max(self._abandoned_generation, generation)

    def _drop_engine(self) -> None:
        if self.snapshots is not None:
            self.snapshots.drop()
        super()._drop_engine()
        gc.collect()  # modules hold reference cycles: free the old engine before a new one is built
        return_freed_memory()

    def preload(self, job: TrainJob, layout: ParallelLayout) -> float:
        """Import what building `job`'s engine imports (engines/preload.py), then freeze what the imports
        made: the full collections that free an old engine before a new one is built then skip the
        libraries' 300,000-odd objects (0.14 s each on an idle core, three per regroup). Returns seconds."""
        seconds = preload(job, layout)
        gc.collect()  # the meta-device model goes first: what is frozen is never collected
        gc.freeze()
        return seconds

    def build_engine(self, job: TrainJob, layout: ParallelLayout, emulated_speed: float = 1.0) -> dict:
        report = super().build_engine(job, layout, emulated_speed)
        previous = self.snapshots.latest() if self.snapshots is not None else None
        if self.engine.snapshot_is_sharded and self._shelf is None:
            self._shelf = self._open_shelf()
        self.snapshots = HostSnapshotter(self.engine, latest=previous, shelf=self._shelf)
        return report

    def _open_shelf(self) -> SnapshotShelf | None:
        name = ray.get_runtime_context().get_actor_name() if ray.is_initialized() else None
        return SnapshotShelf(shelf_directory(name), slots=self.snapshot_slots) if name else None

    def rejoin(
        self, membership: GroupMembership, job: TrainJob, layout: ParallelLayout, emulated_speed: float,
        state_parts: list, fault: Fault | None = None,
    ) -> dict:
        """Join a new generation, build its engine and load the state, in one round trip from the controller.

        `state_parts` are ObjectRefs to canonical parts (one per pipeline stage) that
        other workers' snapshots produced; they travel worker to worker, not through the controller.
        """
        if fault is not None:
            carry_out(fault, lambda speed: None)
        clock = PartClock()
        self.join_group(membership)
        clock.mark("join")
        report = self.build_engine(job, layout, emulated_speed)
        clock.mark("build_engine")
        if state_parts:
            parts = [self._fetch_part(part) for part in state_parts]
            clock.mark("fetch_state")
            whole = len(parts) == 1 and not isinstance(parts[0], ShardedPart)
            self.import_state(parts[0] if whole else assemble_lazily(parts))
            del parts
            gc.collect()  # unmap the shelves read, so a dead worker's is freed once it is removed
            return_freed_memory()
            clock.mark("load_state")
        return {**report, "parts_s": clock.parts}

    def _fetch_part(self, part):
        """An ObjectRef's value, or a shelf's snapshot: mapped in place when the shelf is on this node."""
        if not isinstance(part, ShelfRef):
            return ray.get(part)
        if part.node_id == _ray_placement()[0]:
            found = read_shelf(shelf_directory(part.worker_name), part.step)
            if found is not None:
                return found[1]
        return ray.get(part.reader.read_shelf_of.remote(part.worker_name, part.step))

    def elastic_step(
        self, step: int, *, snapshot: bool = True, fault: Fault | None = None, collective_timeout_s: float | None = None,
        persist_to: str | None = None,
    ) -> dict:
        """One step under the elastic controller: armed faults first, then the step, then a snapshot, and
        with `persist_to` this rank's pieces of it written there (`persisted` says when)."""
        engine = self._require_engine()
        if collective_timeout_s is not None and collective_timeout_s != self._collective_timeout_s:
            self._set_collective_timeout(collective_timeout_s)
        if fault is not None:
            carry_out(fault, engine.set_emulated_speed)
        if self._failed_generation == self.group.membership.generation:
            raise RuntimeError(f"step {step} refused: an earlier step of this process-group generation failed")
        self.current_step = step
        failure = None
        try:
            metrics = engine.train_step(step)
            metrics.update(self._group_totals(metrics, engine.job.train.global_batch_size))
        except BaseException as error:
            self._failed_generation = self.group.membership.generation
            if not isinstance(error, Exception):
                raise
            failure = f"step {step} failed: {error!r}\n{traceback.format_exc()}"
        finally:
            _disarm_and_report_missed_fail_points(step)
        if failure is not None:
            # Raised outside the handler, as text: the error's frames (and a new exception's context)
            # would hold the aborted step's tensors, which must go before the next engine is built.
            del engine
            raise StepFailed(failure)
        if snapshot:
            self.snapshots.after_step(step, then=self._persist_after_copy(step, persist_to) if persist_to else None)
        metrics["snapshot_stall_s"] = self.snapshots.last_stall_s
        self._recent_metrics.append(metrics)
        return metrics

    def _group_totals(self, metrics: dict, batch_size: int) -> dict:
        """The step's loss averaged and its tokens summed over the whole group, and where the ranks drew
        their samples from the policy (PolicySamples) every sample's reward at its place in the batch (each
        rank scored those it trains): any one survivor then reports exactly a step whose other results died
        with a lost worker. One collective for all of it."""
        has_loss = metrics["loss"] is not None
        drawn = metrics.get("policy_samples")
        totals = torch.zeros(3 + (batch_size if drawn else 0), dtype=torch.float64)
        totals[:3] = torch.tensor([metrics["loss"] if has_loss else 0.0, float(has_loss), float(metrics["tokens"])],
                                  dtype=torch.float64)
        if drawn:
            totals[3 + torch.tensor(drawn["positions"], dtype=torch.long)] = torch.tensor(drawn["rewards"],
                                                                                      dtype=torch.float64)
        totals = totals.to(self._device())
        all_reduce_abortable(totals)
        group = {"group_loss": float(totals[0] / totals[1]), "group_tokens": int(totals[2])}
        if drawn:
            kept = {key: value for key, value in drawn.items() if key != "positions"}
            group["policy_samples"] = {**kept, "rewards": totals[3:].cpu().tolist()}
        return group

    @ray.method(concurrency_group="control")
    def recent_metrics(self) -> list[dict]:
        return list(self._recent_metrics)

    @ray.method(concurrency_group="control")
    def abort_step(self) -> None:
        """Release this worker from a collective that a lost peer will never complete; refuse queued steps."""
        if self.group.membership is not None:
            self._failed_generation = self.group.membership.generation
        abort_step()

    def _set_collective_timeout(self, seconds: float) -> None:
        # Survivors blocked on a dead peer are released by this timeout, not gloo's/NCCL's default.
        timeout = datetime.timedelta(seconds=seconds)
        for group in list(dist.distributed_c10d._world.pg_map):
            group.set_timeout(timeout)
        self._collective_timeout_s = seconds

    @ray.method(concurrency_group="control")
    def snapshot_step(self) -> int | None:
        """The step the newest in-memory snapshot was taken after (None: none yet)."""
        latest = self.snapshots.latest() if self.snapshots is not None else None
        return latest[0] if latest is not None else None

    @ray.method(concurrency_group="control")
    def snapshot_with_step(self) -> tuple[int, CanonicalState] | None:
        """(step, copy of the newest snapshot), read together while training may go on."""
        return self.snapshots.latest_copy() if self.snapshots is not None else None

    @ray.method(concurrency_group="control")
    def weights_snapshot_with_step(self) -> tuple[int, CanonicalState] | None:
        """(step, the newest snapshot's weights, packed), for serving them while training goes on."""
        return self.snapshots.latest_weights_copy() if self.snapshots is not None else None

    @ray.method(concurrency_group="control")
    def snapshot_state(self) -> CanonicalState:
        # A copy: the snapshot's buffers are reused two steps later, while Ray may still be sending these.
        latest = self.snapshots.latest_copy() if self.snapshots is not None else None
        if latest is None:
            raise RuntimeError("this worker holds no snapshot")
        return latest[1]

    @ray.method(concurrency_group="control")
    def shelf_steps_of(self, worker_name: str) -> list[int]:
        """The steps of the whole sharded snapshots on the shelf of `worker_name`, a worker of this node
        (this one, or one that died), newest first."""
        return self._shelves.shelf_steps_of(worker_name)

    @ray.method(concurrency_group="control")
    def read_shelf_of(self, worker_name: str, step: int) -> ShardedPart:
        return self._shelves.read_shelf_of(worker_name, step)

    @ray.method(concurrency_group="control")
    def discard_shelf_of(self, worker_name: str) -> None:
        """Remove the shelf a worker of this node left (it died, and its snapshot has been restored)."""
        self._shelves.discard_shelf_of(worker_name)

    @ray.method(concurrency_group="control")
    def discard_shelves(self, run_name: str) -> None:
        """Remove every shelf of run `run_name` on this node and forget this worker's snapshots (the run
        is over): a removed shelf's memory is freed once no worker maps it."""
        if self.snapshots is not None:
            self.snapshots.forget()
        if self._shelf is not None:
            self._shelf = None
            gc.collect()  # a mapping kept alive by a reference cycle would keep the shelf's memory
        shutil.rmtree(run_shelves(run_name), ignore_errors=True)

    @ray.method(concurrency_group="persist")
    def persisted(self, step: int, timeout_s: float = 1800.0) -> tuple[dict[str, dict], float]:
        """(manifest records, seconds) of this rank's files of the checkpoint after `step`, once written."""
        writing = self._persisting.get(step)
        if writing is None:
            raise RuntimeError(f"this worker was not asked to persist step {step}")
        try:
            return writing.result(timeout=timeout_s)
        finally:
            self._persisting.pop(step, None)

    def _persist_after_copy(self, step: int, directory: str):
        """What the snapshot copy of `step` calls with its part, still holding it: write this rank's pieces
        into the checkpoint's staging `directory` (checkpoint/sharded.py), beside the next step."""
        writing = self._persisting[step] = concurrent.futures.Future()
        rank = self.group.membership.rank

        def write(part) -> None:
            started = time.perf_counter()
            try:
                if part is None:
                    raise RuntimeError(f"the snapshot copy of step {step} failed")
                if not isinstance(part, ShardedPart):
                    raise RuntimeError(f"the snapshot of step {step} is whole: the controller persists it")
                writing.set_result((write_rank_part(Path(directory), rank, part), time.perf_counter() - started))
            except Exception as error:  # reported to the committer, never to the step
                writing.set_exception(error)

        return write

    @ray.method(concurrency_group="replica")
    def copy_replica(self, holders: dict[int, ray.actor.ActorHandle], timeout_s: float = 60.0) -> int | None:
        """Copy every stage's newest snapshot (from one holder each) here, on a thread of its own so
        training and heartbeats go on; returns the step of the replica held now (None: none yet).

        Pipeline stages finish a step at different moments, so a first read often finds them a step
        apart: the stages behind are read again once they catch up (within a step), not mixed."""
        deadline = time.monotonic() + timeout_s
        try:
            parts = _read_parts(holders, deadline)
            while parts is not None and (behind := stages_behind({s: part[0] for s, part in parts.items()})):
                newest = max(part[0] for part in parts.values())
                steps = _read({stage: holders[stage].snapshot_step.remote() for stage in behind}, deadline)
                caught_up = {stage: holders[stage] for stage, step in steps.items() if step is not None and step >= newest}
                if caught_up:
                    parts = _merge_reads(parts, _read_parts(caught_up, deadline))
                elif time.monotonic() < deadline:
                    time.sleep(REPLICA_REREAD_PAUSE_S)
                else:
                    parts = None
        except Exception:  # a holder died or lost its snapshot: the replica held stays, the next copy tries again
            parts = None
        if parts is not None:
            self.replica = (next(iter(parts.values()))[0], assemble([part[1] for part in parts.values()]))
        return self.replica[0] if self.replica is not None else None

    @ray.method(concurrency_group="control")
    def replica_step(self) -> int | None:
        return self.replica[0] if self.replica is not None else None

    @ray.method(concurrency_group="control")
    def replica_state(self) -> CanonicalState:
        if self.replica is None:
            raise RuntimeError("this worker holds no replica")
        return self.replica[1]


def _disarm_and_report_missed_fail_points(step: int) -> None:
    missed = disarm_fail_points()
    if missed:  # a crash planned inside a phase this step does not have (a pipeline's backward)
        print(f"baige-ray worker: step {step} never reached fail point(s) {', '.join(missed)}; no crash",
              file=sys.stderr)


def _read(refs: dict, deadline: float) -> dict:
    return {key: ray.get(ref, timeout=max(0.0, deadline - time.monotonic())) for key, ref in refs.items()}


def _read_parts(holders: dict[int, ray.actor.ActorHandle], deadline: float) -> dict[int, tuple[int, CanonicalState]] | None:
    """(step, copy of the newest snapshot) of each holder's stage; None when one holds none."""
    parts = _read({stage: holder.snapshot_with_step.remote() for stage, holder in holders.items()}, deadline)
    return None if None in parts.values() else parts


def _merge_reads(parts: dict | None, newer: dict | None) -> dict | None:
    return None if parts is None or newer is None else {**parts, **newer}
