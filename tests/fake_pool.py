"""An in-process worker pool for the elastic controller's unit tests: no Ray, no processes.

`FakeCluster` holds nodes of device slots; `FakeWorkerPool` starts a `FakeWorker` on a free slot. A
fake worker answers each call the controller makes of a worker actor (`worker.actor.<method>.remote`)
with an answer the controller waits for through `baige_ray.elastic.calls`, as it waits for Ray's. A
worker can be told to die (as SIGKILL leaves it: every call raises RayActorError), freeze (as SIGSTOP
does: nothing answers, heartbeats included), hang in a step (heartbeats answer, the step never ends),
lag (report `lag` times the compute time of the others, which is in proportion to a rank's batch), die
when it reaches a step, or die while
joining a group. A step completes on a rank once every member of its group can run it; a member
that died makes the others' step fail, as a collective with a lost peer does.

Training is a counter: the weights are {"w": steps trained}, and the loss of a step is a function of
the weights it started from, so a run that resumed from the wrong state, or skipped or repeated a
step, reports a loss curve that differs from a fault-free run's.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field

import torch
from ray.exceptions import GetTimeoutError, RayActorError

from baige_ray.api.device import DeviceInfo
from baige_ray.elastic.workers import Worker, WorkerPool


def loss_at(weights: float) -> float:
    return round(10.0 / (1.0 + weights), 6)


class Answered:
    """An answer that is in."""

    def __init__(self, value=None, error: BaseException | None = None):
        self._value, self._error = value, error

    def ready(self) -> bool:
        return True

    def value(self):
        if self._error is not None:
            raise self._error
        return self._value


class Later:
    """An answer that is in once `poll` says so: poll() returns None while it is not, else an Answered."""

    def __init__(self, poll):
        self._poll, self._settled = poll, None

    def ready(self) -> bool:
        if self._settled is None:
            self._settled = self._poll()
        return self._settled is not None

    def value(self):
        if not self.ready():
            raise GetTimeoutError("not answered yet")
        return self._settled.value()


class _Method:
    def __init__(self, worker: FakeWorker, name: str):
        self.worker, self.name = worker, name

    def remote(self, *args, **kwargs):
        return self.worker.call(self.name, args, kwargs)


class FakeActor:
    """What `worker.actor` is for a fake worker: `actor.<method>.remote(...)` returns an answer."""

    def __init__(self, worker: FakeWorker):
        self._worker = worker

    def __getattr__(self, name: str) -> _Method:
        if name.startswith("_"):
            raise AttributeError(name)
        return _Method(self._worker, name)


@dataclass
class Group:
    """One process-group generation: its members by rank, once each has joined."""

    world_size: int
    joined: dict[int, FakeWorker] = field(default_factory=dict)
    abandoned: bool = False

    @property
    def complete(self) -> bool:
        return len(self.joined) == self.world_size


class FakeWorker:
    def __init__(self, cluster: FakeCluster, name: str, node: str, device: int, share: float):
        self.cluster, self.name, self.node, self.device, self.share = cluster, name, node, device, share
        self.alive, self.frozen = True, False
        self.lag = 1.0
        self.batch = 0  # sequences its data-parallel replica trains per step
        self.hang_at: int | None = None  # the step that never ends (heartbeats still answer)
        self.die_at: int | None = None  # the step it dies in
        self.die_in_rejoin = False
        self.freeze_in_rejoin = False
        self.freeze_at: int | None = None  # the step it freezes in
        self._step_began: dict[int, float] = {}
        self.arrived: dict[int, float] = {}  # step -> when this rank reached its collective
        self.group: Group | None = None
        self.generation = -1
        self.failed_generation: int | None = None
        self.weights = 0.0
        self.trained: int | None = None  # the last step it finished
        self.current_step: int | None = None
        self.snapshots: list[tuple[int, dict]] = []
        self.recent: list[dict] = []
        self.calls: list[str] = []

    # ----- faults, as a test injects them -----

    def kill(self) -> None:
        self.alive = False
        self.cluster.release(self)

    def freeze(self) -> None:
        self.frozen = True

    # ----- the actor interface -----

    def call(self, method: str, args: tuple, kwargs: dict):
        self.calls.append(method)
        if not self.alive:
            return Answered(error=RayActorError())
        if self.frozen:
            return Later(lambda: None if self.alive else Answered(error=RayActorError()))
        handler = getattr(self, f"on_{method}")
        return handler(*args, **kwargs)

    def on_device_info(self):
        return Answered(DeviceInfo(node_id=self.node, node_ip=self.node, hostname=self.node, pid=id(self) % 100000,
                                   device_kind="gpu", device_index=self.device, device_name="fake", memory_bytes=0,
                                   ray_resource="GPU", simulated=True))

    def on_heartbeat(self):
        return Answered({"pid": id(self) % 100000, "step": self.current_step, "time": time.time()})

    def on_host_store(self, node_ip: str):
        return Answered(f"store-{next(self.cluster.store_ids)}")

    def on_rejoin(self, membership, job, layout, speed, state_parts, fault=None):
        if self.die_in_rejoin:
            self.kill()
            return Answered(error=RayActorError())
        if self.freeze_in_rejoin:
            self.freeze()
            return Later(lambda: None if self.alive else Answered(error=RayActorError()))
        group = self.cluster.groups.setdefault((membership.store, membership.generation),
                                               Group(membership.world_size))
        group.joined[membership.rank] = self
        self.group, self.generation, self.rank, self.job = group, membership.generation, membership.rank, job
        self.batch = layout.replica_batches(job.train)[layout.coords(membership.rank).dp]
        if state_parts:
            (part,) = state_parts
            state = part.value() if hasattr(part, "ready") else part
            self.weights = state["model"]["w"]
        else:
            self.weights = 0.0
        self.trained, self.arrived, self._step_began = None, {}, {}

        def joined():
            if group.abandoned:
                return Answered(error=RuntimeError(f"generation {membership.generation} abandoned"))
            if any(not member.alive for member in group.joined.values()):
                return Answered(error=RuntimeError("a peer died while the group formed"))
            return Answered({"num_parameters": 1, "data": None}) if group.complete else None

        return Later(joined)

    def on_abandon_generation(self, generation: int):
        for (_, number), group in self.cluster.groups.items():
            if number <= generation:
                group.abandoned = True
        return Answered(None)

    def on_elastic_step(self, step: int, *, snapshot=True, fault=None, collective_timeout_s=None, persist_to=None):
        group, generation = self.group, self.generation

        def poll():
            if not self.alive:
                return Answered(error=RayActorError())
            if self.hang_at == step and self.trained == step - 1:  # stuck where no abort reaches
                self.current_step = step
                return None
            if self.failed_generation == generation:
                return Answered(error=RuntimeError(f"step {step} refused: an earlier step of this generation failed"))
            if self.trained is not None and self.trained < step - 1:
                return None  # the step queued ahead waits for the one before it
            self.current_step = step
            if self.die_at == step:
                self.kill()
                return Answered(error=RayActorError())
            if self.freeze_at == step:
                self.freeze()
                return None
            began = self._step_began.setdefault(step, time.monotonic())
            if time.monotonic() - began < self.cluster.step_s * self.lag:
                return None
            arrived = self.arrived.setdefault(step, time.monotonic())  # in the step's collective
            peers = list(group.joined.values())
            if any(not peer.alive for peer in peers):
                self.failed_generation = generation
                return Answered(error=RuntimeError("a collective's peer was lost"))
            if any(step not in peer.arrived for peer in peers):
                if collective_timeout_s is not None and time.monotonic() - arrived > collective_timeout_s:
                    self.failed_generation = generation
                    return Answered(error=RuntimeError(f"collective timed out after {collective_timeout_s}s"))
                return None  # waits for its peers in the collective
            return Answered(self._finish(step, snapshot))

        return Later(poll)

    def _finish(self, step: int, snapshot: bool) -> dict:
        loss = loss_at(self.weights)
        self.weights += 1
        self.trained = step
        if snapshot:
            self.snapshots = (self.snapshots + [(step, {"model": {"w": self.weights}, "optimizer": {}})])[-2:]
        metrics = {"step": step, "loss": loss, "group_loss": loss, "learning_rate": 0.1, "tokens": 8,
                   "group_tokens": 8 * self.group.world_size, "compute_s": 0.0025 * self.batch * self.lag,
                   "snapshot_stall_s": 0.0}
        self.recent = (self.recent + [metrics])[-16:]
        self.cluster.after_step(self, step)
        return metrics

    def on_abort_step(self):
        self.failed_generation = self.generation
        return Answered(None)

    def on_snapshot_step(self):
        return Answered(self.snapshots[-1][0] if self.snapshots else None)

    def on_snapshot_state(self):
        if not self.snapshots:
            return Answered(error=RuntimeError("this worker holds no snapshot"))
        return Answered(self.snapshots[-1][1])

    def on_snapshot_with_step(self):
        return Answered(self.snapshots[-1] if self.snapshots else None)

    def on_recent_metrics(self):
        return Answered(list(self.recent))

    def on_export_weights(self):
        model = self.job.plugin.build_model()
        return Answered({name: torch.full_like(tensor, self.weights) for name, tensor in model.state_dict().items()})

    def on_discard_shelves(self, run_name: str):
        return Answered(None)


class FakeCluster:
    """Nodes of device slots (a slot holds one whole worker, or harvest ranks beside a replica)."""

    def __init__(self, nodes: dict[str, int]):
        self.slots = {node: [None] * count for node, count in nodes.items()}
        self.groups: dict[tuple, Group] = {}
        self.workers: list[FakeWorker] = []
        self.store_ids = itertools.count()
        self.scripted: dict[int, dict] = {}  # start index -> attributes its worker starts with (faults)
        self.step_s = 0.0  # how long a step takes (times a worker's lag)
        self.hooks: list = []  # hook(worker, step) after a rank finishes a step

    def after_step(self, worker: FakeWorker, step: int) -> None:
        for hook in self.hooks:
            hook(worker, step)

    def place(self, name: str, share: float) -> FakeWorker | None:
        for node, devices in self.slots.items():
            for index, holder in enumerate(devices):
                if holder is None:
                    worker = FakeWorker(self, name, node, index, share)
                    for attribute, value in self.scripted.get(len(self.workers), {}).items():
                        setattr(worker, attribute, value)
                    devices[index] = worker
                    self.workers.append(worker)
                    return worker
        return None

    def release(self, worker: FakeWorker) -> None:
        devices = self.slots.get(worker.node, [])
        if worker.device < len(devices) and devices[worker.device] is worker:
            devices[worker.device] = None

    def free(self) -> int:
        return sum(holder is None for devices in self.slots.values() for holder in devices)

    def add_node(self, node: str, devices: int) -> None:
        self.slots[node] = [None] * devices

    def lose_node(self, node: str) -> None:
        for worker in self.slots.pop(node):
            if worker is not None:
                worker.alive = False

    def named(self, name: str) -> FakeWorker:
        return next(w for w in self.workers if w.name == name)

    def live(self) -> list[FakeWorker]:
        return [w for w in self.workers if w.alive]


class FakeWorkerPool(WorkerPool):
    """WorkerPool's interface over a FakeCluster: starts, finds and stops fake workers."""

    def __init__(self, cluster: FakeCluster, run_name: str = "fake"):
        self.cluster, self.run_name = cluster, run_name
        self.names = itertools.count(len(cluster.workers))
        self.severed = False  # its controller is gone: what it still asks for never happens

    def sever(self) -> None:
        self.severed = True

    def start(self, count: int, speeds: list[float] | None = None, share: float = 1.0) -> list[Worker]:
        started = []
        for index in range(count):
            name = f"baige-worker:{self.run_name}:{next(self.names)}"
            fake = self.cluster.place(name, share)
            if fake is None:  # no device free: it never comes up, as a pending Ray actor does not
                started.append(Worker(actor=None, name=name, speed=1.0, share=share, ready_ref=Later(lambda: None)))
                continue
            worker = Worker(actor=FakeActor(fake), name=name, speed=(speeds or [1.0] * count)[index], share=share)
            worker.ready_ref = worker.actor.device_info.remote()
            started.append(worker)
        return started

    def free_devices(self) -> int:
        return self.cluster.free()

    def stop(self, workers: list[Worker]) -> None:
        if self.severed:
            return
        for worker in workers:
            if worker.actor is not None:
                self.cluster.named(worker.name).kill()

    def stop_strays(self, known: set[str]) -> int:
        strays = [w for w in self.cluster.live() if w.name not in known]
        for worker in strays:
            worker.kill()
        return len(strays)

    def find(self, name: str, speed: float, share: float = 1.0) -> Worker:
        fake = next((w for w in self.cluster.live() if w.name == name), None)
        if fake is None:
            return Worker(actor=None, name=name, speed=speed, share=share)
        worker = Worker(actor=FakeActor(fake), name=name, speed=speed, share=share)
        worker.info = worker.actor.device_info.remote().value()
        return worker

    @staticmethod
    def put(value):
        return Answered(value)


class MemoryKeyValueStore:
    """The job record's store, in a dict (Ray keeps it in its GCS); a severed view ignores writes."""

    def __init__(self, values: dict | None = None):
        self.values: dict[str, str] = {} if values is None else values
        self.severed = False

    def view(self) -> MemoryKeyValueStore:
        return MemoryKeyValueStore(self.values)

    def put(self, key: str, value: str) -> None:
        if not self.severed:
            self.values[key] = value

    def get(self, key: str) -> str | None:
        return self.values.get(key)

    def delete(self, key: str) -> None:
        if not self.severed:
            self.values.pop(key, None)
