"""The Ray layer of the elastic controller: start, name, order, re-group and stop worker actors one by one.

Unlike `WorkerGroup` (one placement group for a fixed-size job), an elastic job
adds and removes single workers, so each actor reserves its own device. Workers
are detached and named after the run, so they outlive a crashed controller and
its restarted successor finds them again.
"""

from __future__ import annotations

import time
import uuid
import warnings
from dataclasses import dataclass, field
from typing import Any

import ray
from ray.exceptions import GetTimeoutError, RayActorError

from baige_ray.api.configs import ScalingConfig
from baige_ray.api.device import DeviceInfo
from baige_ray.elastic import calls
from baige_ray.elastic.heartbeats import SILENT, Heartbeats
from baige_ray.elastic.liveness import LivenessListener
from baige_ray.engines.host_allocator import worker_runtime_env
from baige_ray.parallel.distributed import GroupMembership
from baige_ray.runtime.resources import worker_bundle

NAMESPACE = "baige"


@dataclass
class Worker:
    actor: ray.actor.ActorHandle
    name: str
    info: DeviceInfo | None = None
    speed: float = 1.0  # the chip speed it emulates
    share: float = 1.0  # the fraction of its device it holds: < 1 for a rank harvesting a serving device
    ready_ref: ray.ObjectRef | None = field(default=None, repr=False)

    def describe(self, rank: int | None) -> dict:
        """What the job's status says of it, at rank `rank` (None: a spare)."""
        info = self.info
        if info is None:  # lost, or not found after a controller restart
            return {"rank": rank, "node_id": None, "node_ip": None, "device_index": None, "pid": None,
                    "speed": self.speed, "share": self.share}
        return {"rank": rank, "node_id": info.node_id, "node_ip": info.node_ip,
                "device_index": info.device_index, "pid": info.pid, "speed": self.speed, "share": self.share}


def _answered(beat: ray.ObjectRef) -> bool:
    try:
        calls.get(beat, timeout=0)
        return True
    except Exception:  # dead, or silent for the wait before
        return False


class MemberSilent(RuntimeError):
    """A member stopped answering heartbeats while the group regrouped (frozen: SIGSTOP, a hung host)."""

    def __init__(self, message: str, names: tuple[str, ...] = ()):
        super().__init__(message)
        self.names = names  # the silent members' worker names: known unresponsive, not asked again


HEARTBEAT_POLL_S = 0.25  # how often a regroup looks at its members' answers and heartbeats


class WorkerPool:
    # Where workers connect so that their process's exit is seen at once (liveness.py); None: heartbeats only.
    liveness: LivenessListener | None = None
    # A member silent this long while regrouping is taken for frozen (building an engine and loading
    # state keep the control thread answering, as a step does; a stopped process answers nothing).
    regroup_silence_s = 5.0

    def __init__(self, scaling: ScalingConfig, run_name: str, resource: str, remote_cls: Any,
                 snapshot_slots: int = 2, preload: tuple | None = None, liveness: LivenessListener | None = None):
        """`remote_cls`: the worker actor class under `ray.remote`, with its concurrency groups. `preload`:
        (job, layout) whose engine each worker imports as soon as it starts, so that a spare joins warm.
        `liveness`: the listener each worker connects to as it starts."""
        self.preload, self.liveness = preload, liveness
        self.scaling = scaling
        self.snapshot_slots = snapshot_slots
        self.run_name = run_name
        self.resource = resource
        self._remote_cls = remote_cls

    def start(self, count: int, speeds: list[float] | None = None, share: float = 1.0) -> list[Worker]:
        """Start `count` actors without waiting for them; `ready()` collects those that came up.

        `share` < 1 asks for that fraction of a device, so the actor lands beside an actor holding
        the rest of one (a Serve replica asking for 1 - share), not on a device of its own."""
        bundle = worker_bundle(self.scaling, self.resource)
        if share < 1:
            if self.resource == "CPU":
                raise ValueError("a device share below 1 needs accelerators (real or simulated); this job runs on CPUs")
            bundle[self.resource] = share
        custom = {name: amount for name, amount in bundle.items() if name not in ("CPU", "GPU")}
        started = []
        for index in range(count):
            name = f"baige-worker:{self.run_name}:{uuid.uuid4().hex[:8]}"
            actor = self._remote_cls.options(
                name=name,
                namespace=NAMESPACE,
                lifetime="detached",
                num_cpus=bundle.get("CPU", 0.0),
                num_gpus=bundle.get("GPU", 0.0),
                resources=custom,
                runtime_env=worker_runtime_env(self.scaling.host_allocator),
            ).remote(cpu_niceness=self.scaling.cpu_niceness, snapshot_slots=self.snapshot_slots)
            worker = Worker(actor=actor, name=name, speed=(speeds or [1.0] * count)[index], share=share)
            worker.ready_ref = actor.device_info.remote()
            self._watch_liveness(worker)
            if self.preload is not None:  # queued before anything else asked of it: a regroup waits for it
                actor.preload.remote(*self.preload)
            started.append(worker)
        return started

    def _watch_liveness(self, worker: Worker) -> None:
        if self.liveness is not None and worker.actor is not None:
            worker.actor.connect_liveness.remote(self.liveness.address, worker.name)

    def exited(self, workers: list[Worker]) -> set[str]:
        """Names of those of `workers` whose process has exited, as their closed connection says."""
        if self.liveness is None:
            return set()
        return set(self.liveness.exited([w.name for w in workers]))

    def start_and_wait(self, count: int, share: float, timeout_s: float) -> list[Worker]:
        """Start `count` workers holding `share` of a device each and wait up to `timeout_s` for them;
        those not up by then are stopped."""
        started = self.start(count, share=share)
        up = self.ready(started, timeout_s)
        self.stop([worker for worker in started if worker not in up])
        return up

    @staticmethod
    def ready(workers: list[Worker], timeout_s: float = 0.0) -> list[Worker]:
        """Those of `workers` whose actor is up (their device info arrived) within `timeout_s`."""
        pending = [w.ready_ref for w in workers if w.info is None and w.ready_ref is not None]
        if pending:
            calls.wait(pending, num_returns=len(pending), timeout=timeout_s)
        up = []
        for worker in workers:
            if worker.info is None and worker.ready_ref is not None:
                try:
                    worker.info = calls.get(worker.ready_ref, timeout=0)
                except GetTimeoutError:
                    continue
                except RayActorError:
                    worker.ready_ref = None  # never came up; the caller drops it
                    continue
            if worker.info is not None:
                up.append(worker)
        return up

    @staticmethod
    def responsive(workers: list[Worker], timeout_s: float = 1.0) -> list[bool]:
        """Whether each worker answers a heartbeat (on its control thread, so a busy one answers too). One
        without an actor (a member a restarted controller did not find) does not."""
        beats = [worker.actor.heartbeat.remote() if worker.actor is not None else None for worker in workers]
        sent = [beat for beat in beats if beat is not None]
        if sent:
            calls.wait(sent, num_returns=len(sent), timeout=timeout_s)
        return [beat is not None and _answered(beat) for beat in beats]

    def free_devices(self) -> int:
        bundle = worker_bundle(self.scaling, self.resource)
        available = ray.available_resources()
        return int(min(available.get(name, 0.0) // amount for name, amount in bundle.items() if amount > 0))

    @staticmethod
    def stop(workers: list[Worker]) -> None:
        for worker in workers:
            try:
                ray.kill(worker.actor, no_restart=True)
            except Exception:  # already gone
                pass

    @staticmethod
    def discard_shelves(workers: list[Worker], run_name: str, timeout_s: float = 10.0) -> None:
        """Remove the run's snapshot shelves (shelf.py) from every node that has one of `workers`; each
        of `workers` lets go of its snapshots, so their memory is freed, not only their files."""
        refs = [w.actor.discard_shelves.remote(run_name) for w in workers if w.actor is not None]
        if refs:
            calls.wait(refs, num_returns=len(refs), timeout=timeout_s)

    def stop_strays(self, known: set[str]) -> int:
        """Stop this run's live workers whose names are not in `known`: spares or harvest ranks an
        earlier controller started, which one Ray restarted does not know. Returns how many."""
        return kill_named_actors((f"baige-worker:{self.run_name}:",), keep=known)

    def find(self, name: str, speed: float, share: float = 1.0) -> Worker:
        """The live worker named `name` (after a controller restart, connected to this one's liveness
        listener); without actor and info if it is gone."""
        try:
            actor = ray.get_actor(name, namespace=NAMESPACE)
            info = ray.get(actor.device_info.remote(), timeout=10)
        except Exception:
            return Worker(actor=None, name=name, speed=speed, share=share)
        worker = Worker(actor=actor, name=name, speed=speed, share=share, info=info)
        self._watch_liveness(worker)
        return worker

    @staticmethod
    def put(value) -> ray.ObjectRef:
        """`value` in the object store, for the driver or workers to fetch."""
        return ray.put(value)

    @staticmethod
    def by_locality(workers: list[Worker]) -> list[Worker]:
        return sorted(workers, key=lambda w: w.info.location)

    def regroup(self, members: list[Worker], generation: int, job, layout, state_parts: list, timeout_s: float,
                faults: dict | None = None) -> list[dict]:
        """Join `members`, in rank order, into generation `generation`; each builds its engine and loads the state.

        Returns each rank's engine report (parameter count, data fingerprint). Raises as soon as one
        member fails or falls silent (MemberSilent): the others are still waiting for it, and the
        caller abandons the generation."""
        first = members[0]
        store = calls.get(first.actor.host_store.remote(first.info.node_ip), timeout=timeout_s)
        faults = faults or {}
        refs = [
            worker.actor.rejoin.remote(
                GroupMembership(store=store, rank=rank, world_size=len(members), generation=generation),
                job, layout, worker.speed, state_parts, faults.get(rank),
            )
            for rank, worker in enumerate(members)
        ]
        return self._answers_while_heard(refs, members, timeout_s)

    def _answers_while_heard(self, refs: list, members: list[Worker], timeout_s: float) -> list:
        """Every member's answer; the first failure raises at once, and so does a member still working
        that answers no heartbeat for `regroup_silence_s`."""
        deadline = time.monotonic() + timeout_s
        pending = dict(zip(refs, range(len(refs))))
        heartbeats = Heartbeats(self.regroup_silence_s)
        while pending:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise GetTimeoutError(f"{len(pending)} of {len(refs)} members unanswered after {timeout_s:.0f}s")
            done, _ = calls.wait(list(pending), num_returns=1, timeout=min(HEARTBEAT_POLL_S, remaining))
            for ref in done:
                calls.get(ref)  # raises the member's own failure
                del pending[ref]
            lost = heartbeats.unresponsive({rank: members[rank] for rank in pending.values()}, time.monotonic())
            silent = [rank for rank, why in sorted(lost.items()) if why == SILENT]  # the dead raise above soon
            if silent:
                raise MemberSilent(f"rank(s) {silent} answered no heartbeat for {self.regroup_silence_s:g}s "
                                   f"while regrouping", names=tuple(members[rank].name for rank in silent))
        return calls.get(refs)

    @staticmethod
    def abandon(workers: list[Worker], generation: int, timeout_s: float = 2.0) -> None:
        """Release the workers still waiting to join `generation` (answered on their control threads)."""
        refs = [worker.actor.abandon_generation.remote(generation) for worker in workers]
        calls.wait(refs, num_returns=len(refs), timeout=timeout_s)


def restarted_by_ray() -> bool:
    """Whether Ray restarted the calling actor after its process died (its first run says no)."""
    with warnings.catch_warnings():  # Ray warns about an internal property this one reads
        warnings.simplefilter("ignore", DeprecationWarning)
        return ray.get_runtime_context().was_current_actor_reconstructed


def kill_named_actors(prefixes: tuple[str, ...], keep: set[str] = frozenset()) -> int:
    """Kill baige's named actors whose names start with one of `prefixes`, except those in `keep`;
    returns how many."""
    killed = 0
    for entry in ray.util.list_named_actors(all_namespaces=True):
        name = entry["name"]
        if entry["namespace"] == NAMESPACE and name.startswith(prefixes) and name not in keep:
            try:
                ray.kill(ray.get_actor(name, namespace=NAMESPACE), no_restart=True)
                killed += 1
            except ValueError:  # gone meanwhile
                pass
    return killed
