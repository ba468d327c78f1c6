"""The soak's faults carried out on the live pool: real signals to real processes, a node taken away and
given back, a persisted checkpoint damaged on disk.

`FaultInjector.inject` carries out one scheduled fault and returns what it did (wall-clock `at`, the
process or node hit). How the job noticed and recovered is read afterwards from its event log
(soak.py); a replica kill is followed here, from Ray's list of live actors.

- worker_kill / worker_freeze / straggler: SIGKILL, SIGSTOP, or SIGSTOP/SIGCONT in turns to one worker.
- replica_kill: SIGKILL to one serving replica; detected when Ray lists it dead, recovered when the
  application has as many replicas as before.
- controller_kill: SIGKILL to the job's controller; Ray restarts it and it finds its workers again.
- arbiter_kill: SIGKILL to the pool arbiter; detected when Ray has restarted it (its new process answers),
  recovered at its first decision after that.
- node_loss: the simulated worker node stopped (every process on it dies at once, workers and
  replicas alike) and started again `NODE_DOWN_S` later; the job shrinks, then grows back.
- checkpoint_corrupt: the newest persisted checkpoint's largest file damaged in the middle (size
  unchanged) as it commits, then the hosts' memory lost as in a reboot (every worker and spare frozen,
  the run's snapshot shelves removed, each of them SIGKILLed), so the job must restore from disk and meets the
  damage: it has to skip that checkpoint (its checksum) and restore the one before. (Workers killed
  on hosts that stay up leave their shelves, and the job restores from those instead.)
- checkpoint_disk_full: the checkpoints' volume (a tmpfs of its own, `checkpoint_volume`) filled to the
  last byte for `DISK_FULL_S`, then freed; the job trains on, records each checkpoint that failed, and
  persists again once there is room. Without the right to mount (not root) it is not injected.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from baige_ray.bench.soak_schedule import ScheduledFault, Throttle
from baige_ray.elastic.shelf import run_shelves
from baige_ray.rl.faults import live_replica_pids, replica_pids

REPLICA_RECOVERY_WAIT_S = 120.0
ARBITER_RECOVERY_WAIT_S = 120.0
NODE_DOWN_S = 20.0
REGROW_WAIT_S = 120.0
STRAGGLER_LIMIT_S = 90.0
WORKERS_WAIT_S = 120.0
DISK_FULL_S = 20.0  # a checkpoint is due every 2-3 s in the soak: several fail
DISK_FULL_MAX_S = 90.0
COMMIT_WAIT_S = 30.0  # a checkpoint commits every 1-3 s in the soak
VOLUME_SIZE = "128m"  # the checkpoints' tmpfs: a tiny model's few checkpoints take a few MB
FILLER_NAME = "soak-filler.bin"


def replicas_wanted(before_kill: int, infer_devices: int | None) -> int:
    """How many replicas the application must have again for a replica kill to count as recovered: as
    many as before it, or fewer where the arbiter took a device back from serving meanwhile (the soak
    serves one replica a device). A seed-2 soak killed one of 3 replicas 5 s before a reclaim."""
    return before_kill if infer_devices is None else min(before_kill, infer_devices)


class FaultInjector:
    """Faults on one soak's job (`job`, run `run_name`), application `app_name`, pool arbiter (an actor
    handle) and persisted checkpoints under `checkpoints`; every pid it touches goes into `seen_pids`
    (for the left-behind check)."""

    def __init__(self, job, run_name: str, app_name: str, arbiter, checkpoints: Path, seen_pids: set[int], *,
                 checkpoints_on_own_volume: bool):
        self.job, self.run_name, self.app_name, self.arbiter = job, run_name, app_name, arbiter
        self.checkpoints, self.seen_pids = Path(checkpoints), seen_pids
        self.checkpoints_on_own_volume = checkpoints_on_own_volume

    def inject(self, fault: ScheduledFault) -> dict[str, Any]:
        return {
            "worker_kill": self._signal_worker,
            "worker_freeze": self._signal_worker,
            "straggler": self._signal_worker,
            "replica_kill": self._kill_replica,
            "controller_kill": self._kill_controller,
            "arbiter_kill": self._kill_arbiter,
            "node_loss": self._lose_node,
            "checkpoint_corrupt": self._corrupt_checkpoint,
            "checkpoint_disk_full": self._fill_checkpoint_disk,
        }[fault.kind](fault)

    # ----- processes -----

    def _worker_pids(self) -> list[int]:
        return [w["pid"] for w in self._live_workers()]

    def _live_workers(self) -> list[dict]:
        """The job's live workers (as its status describes them); while it has none (still restoring from
        an earlier fault), the fault waits for them: a worker fault needs a worker to hit."""
        deadline = time.monotonic() + WORKERS_WAIT_S
        while not (workers := [w for w in self.job.status()["workers"] if process_alive(w["pid"])]):
            if time.monotonic() > deadline:
                raise RuntimeError(f"the job had no live worker for {WORKERS_WAIT_S:g} s")
            time.sleep(0.25)
        self.seen_pids.update(w["pid"] for w in workers)
        return workers

    def _spare_pids(self) -> list[int]:
        pids = [s["pid"] for s in self.job.status()["spares"] if s["pid"] is not None and process_alive(s["pid"])]
        self.seen_pids.update(pids)
        return pids

    def _signal_worker(self, fault: ScheduledFault) -> dict[str, Any]:
        pids = self._worker_pids()
        pid = pids[fault.pick % len(pids)]
        outcome = {"kind": fault.kind, "at": time.time(), "pid": pid}
        if fault.kind == "worker_kill":
            os.kill(pid, signal.SIGKILL)
        elif fault.kind == "worker_freeze":
            os.kill(pid, signal.SIGSTOP)
        else:
            outcome["throttle"] = Throttle(pid, limit_s=STRAGGLER_LIMIT_S)
        return outcome

    def _kill_controller(self, fault: ScheduledFault) -> dict[str, Any]:
        from ray.util.state import list_actors

        from baige_ray.api.connection import state_api_address

        name = f"baige-controller:{self.run_name}"
        alive = list_actors(address=state_api_address(), filters=[("name", "=", name), ("state", "=", "ALIVE")])
        if not alive:
            raise RuntimeError(f"no live controller named {name!r} to kill")
        pid = alive[0].pid
        self.seen_pids.add(pid)
        at = time.time()
        os.kill(pid, signal.SIGKILL)
        return {"kind": fault.kind, "at": at, "pid": pid}

    def _kill_arbiter(self, fault: ScheduledFault) -> dict[str, Any]:
        import ray

        pid = ray.get(self.arbiter.status.remote(), timeout=60)["pid"]
        self.seen_pids.add(pid)
        at = time.time()
        os.kill(pid, signal.SIGKILL)
        detected = recovered = None
        while time.time() - at < ARBITER_RECOVERY_WAIT_S and recovered is None:
            time.sleep(0.25)
            try:
                status = ray.get(self.arbiter.status.remote(), timeout=5)
            except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):  # not restarted yet
                continue
            if status["pid"] == pid:
                continue  # the signal has not landed yet
            self.seen_pids.add(status["pid"])
            detected = detected or time.time() - at
            if status["last_decision"] is not None:
                recovered = time.time() - at
        return {"kind": fault.kind, "at": at, "pid": pid, "detected_s": detected, "recovered_s": recovered,
                "steps_lost": 0}

    def _kill_replica(self, fault: ScheduledFault) -> dict[str, Any]:
        before = replica_pids(self.app_name)
        self.seen_pids.update(before)
        pid = before[fault.pick % len(before)]
        at = time.time()
        os.kill(pid, signal.SIGKILL)
        detected = recovered = None
        while time.time() - at < REPLICA_RECOVERY_WAIT_S and recovered is None:
            time.sleep(0.25)
            alive = self._replica_pids()
            if detected is None and pid not in alive:
                detected = time.time() - at
            if detected is not None and len(alive) >= replicas_wanted(len(before), self._infer_devices()):
                recovered = time.time() - at
        return {"kind": fault.kind, "at": at, "pid": pid, "detected_s": detected, "recovered_s": recovered,
                "steps_lost": 0}

    def _infer_devices(self) -> int | None:
        """The devices the arbiter gives serving now (None while it is down or restarting)."""
        import ray

        try:
            return ray.get(self.arbiter.status.remote(), timeout=5)["infer_devices"]
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
            return None

    def _replica_pids(self, on_node: str | None = None) -> list[int]:
        pids = live_replica_pids(self.app_name, on_node=on_node)
        self.seen_pids.update(pids)
        return pids

    # ----- a node -----

    def _lose_node(self, fault: ScheduledFault) -> dict[str, Any]:
        """Stop a worker node, start it again NODE_DOWN_S later; how long the pool took to regrow. A node
        holding none of the job's workers is noticed by serving alone (its replicas), or by nothing."""
        from baige_ray.topology.simulated import SimulatedCluster

        cluster = SimulatedCluster.active()
        indices = cluster.worker_node_indices
        index = indices[fault.pick % len(indices)]
        node_type, node_id = cluster.node_type_of(index), cluster.node_id_of(index)
        workers = self._live_workers()
        workers_on_node = sum(w["node_id"] == node_id for w in workers)
        replicas_on_node = self._replica_pids(on_node=node_id)
        at = time.time()
        if not workers_on_node and not replicas_on_node:
            return {"kind": fault.kind, "at": at, "node": index,
                    "skipped": "the node held none of the job's workers and no replica"}
        cluster.remove_node(index)
        replicas_gone = None
        while time.time() - at < NODE_DOWN_S:
            if replicas_gone is None and not set(replicas_on_node) & set(self._replica_pids()):
                replicas_gone = time.time() - at
            time.sleep(0.25)
        cluster.add_node(node_type, index)
        back = time.time()
        regrown = None
        while time.time() - back < REGROW_WAIT_S:
            if self._split_restored():
                regrown = time.time() - at
                break
            time.sleep(0.5)
        outcome = {"kind": fault.kind, "at": at, "node": index, "workers_on_node": workers_on_node,
                   "replicas_on_node": len(replicas_on_node), "back_s": round(back - at, 3), "regrown_s": regrown}
        if not workers_on_node:  # the job saw nothing: serving's loss and return are the figures
            outcome.update(detected_s=replicas_gone, recovered_s=regrown, steps_lost=0)
        return outcome

    def _split_restored(self) -> bool:
        """Whether training and serving hold the devices the arbiter gives them now: a lend or a reclaim
        while the node was down changed what they should grow back to."""
        import ray

        try:
            wanted = ray.get(self.arbiter.status.remote(), timeout=10)
        except (ray.exceptions.RayError, TimeoutError):  # restarting (a killed arbiter): ask again
            return False
        return (self.job.status()["num_workers"] >= wanted["train_devices"]
                and len(self._replica_pids()) >= wanted["infer_devices"])

    # ----- a checkpoint -----

    def _corrupt_checkpoint(self, fault: ScheduledFault) -> dict[str, Any]:
        """Damage the newest persisted checkpoint just as it commits, then kill every worker and spare: no
        write is in flight then (the next is due 25 steps later) that could land a newer, intact one before
        the job restores (a checkpoint written beside training commits after its workers died). The spares
        too: one may hold a copy of the snapshots (a job on one node replicates them to another), and the
        job then restores from that copy, never reading the disk (twice in a 30-minute soak)."""
        committed = self._next_commit()
        pids = self._worker_pids() + self._spare_pids()
        if not committed:
            return {"kind": fault.kind, "at": time.time(), "pids": pids, "corrupted_step": None}
        step, path = committed[-1]
        damaged = damage_largest_file(path)
        at = time.time()
        for pid in pids:  # frozen first: no snapshot lands on a shelf between its removal and the kill
            os.kill(pid, signal.SIGSTOP)
        shutil.rmtree(run_shelves(self.run_name), ignore_errors=True)  # the simulated nodes share this host's
        for pid in pids:
            os.kill(pid, signal.SIGKILL)
        return {"kind": fault.kind, "at": at, "pids": pids, "corrupted_step": step, "damaged": str(damaged)}

    def _next_commit(self) -> list:
        """The committed checkpoints once one more has committed (or COMMIT_WAIT_S has passed)."""
        from baige_ray.checkpoint.store import list_checkpoints

        def newest() -> int | None:
            committed = list_checkpoints(self.checkpoints)
            return committed[-1][0] if committed else None

        before, deadline = newest(), time.monotonic() + COMMIT_WAIT_S
        while newest() == before and time.monotonic() < deadline:
            time.sleep(0.01)
        return list_checkpoints(self.checkpoints)

    def _fill_checkpoint_disk(self, fault: ScheduledFault) -> dict[str, Any]:
        at = time.time()
        if not self.checkpoints_on_own_volume:
            return {"kind": fault.kind, "at": at, "skipped": "the checkpoints are not on a volume of their own "
                                                               "(mounting one needs root): filling it would fill /tmp"}
        filler = self.checkpoints / FILLER_NAME
        filled = fill_volume(filler)
        # Full for DISK_FULL_S, and longer if no checkpoint was due meanwhile (the job recovering from
        # another fault writes none): the fault is that a write meets the full disk.
        while time.time() < at + DISK_FULL_MAX_S and (time.time() < at + DISK_FULL_S or not self._persist_failed(at)):
            time.sleep(0.5)
        filler.unlink()
        return {"kind": fault.kind, "at": at, "filled_bytes": filled, "freed_at": time.time()}

    def _persist_failed(self, since: float) -> bool:
        return any(e["time"] >= since and persist_failed(e) for e in self.job.status()["events"])


def persist_failed(event: dict) -> bool:
    """Whether a job event says a checkpoint could not be written."""
    return (event["kind"] == "checkpoint" and event["reason"].startswith("persisting step")
            and " failed: " in event["reason"])


@contextlib.contextmanager
def checkpoint_volume(path: Path) -> Iterator[bool]:
    """`path` as a tmpfs of its own while the context lasts, so that filling it fills no other disk;
    yields False (and mounts nothing) where mounting is not allowed."""
    path.mkdir(parents=True, exist_ok=True)
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={VOLUME_SIZE}", "tmpfs", str(path)],
                             capture_output=True).returncode == 0
    try:
        yield mounted
    finally:
        if mounted:
            subprocess.run(["umount", "--lazy", str(path)], capture_output=True)


def fill_volume(filler: Path, chunk_bytes: int = 1 << 20) -> int:
    """Write zeros to `filler` until its volume has no byte left; returns how many were written."""
    written, size = 0, chunk_bytes
    descriptor = os.open(filler, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        while size >= 1:
            try:
                written += os.write(descriptor, bytes(size))
            except OSError as error:
                if error.errno != errno.ENOSPC:
                    raise
                size //= 2  # the last bytes, in smaller writes
        return written
    finally:
        os.close(descriptor)


def damage_largest_file(checkpoint: Path, length: int = 64) -> Path:
    """Invert `length` bytes in the middle of the largest file of `checkpoint` (its size unchanged, as a bad
    sector or a torn overwrite leaves it); returns the file."""
    largest = max((p for p in checkpoint.iterdir() if p.is_file()), key=lambda p: p.stat().st_size)
    middle = largest.stat().st_size // 2
    with open(largest, "r+b") as file:
        file.seek(middle)
        original = file.read(length)
        file.seek(middle)
        file.write(bytes(byte ^ 0xFF for byte in original))
    return largest


def process_alive(pid: int | None) -> bool:
    """Whether `pid` is a running process, not a zombie. While a job recovers, its status still lists the
    members of the generation that last formed, the dead among them (a node loss would hit none of those)."""
    import psutil

    try:
        return pid is not None and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
