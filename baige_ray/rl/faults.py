"""Faults for rollout replicas, scheduled by iteration: a replica SIGKILLed while it generates.

`RolloutFaultPlan` is what `GRPOTrainer(rollout_faults=...)` fires: at iteration t, `after_s`
seconds after a replica sampled the first token of a group (it holds requests), that replica is killed
with SIGKILL (a real signal to the process id it reported). Serve starts a replacement; the requests
it held are re-issued to the others (rl/rollouts.py).
"""

from __future__ import annotations

import dataclasses
import os
import signal
import threading
import time

from baige_ray.rl.rollouts import BusyReplicas

START_TIMEOUT_S = 120.0


@dataclasses.dataclass(frozen=True)
class ReplicaKill:
    iteration: int
    after_s: float


@dataclasses.dataclass
class RolloutFaultPlan:
    kills: list[ReplicaKill] = dataclasses.field(default_factory=list)
    fired: list[dict] = dataclasses.field(default_factory=list)

    def kill_replica(self, iteration: int, after_s: float = 0.0) -> RolloutFaultPlan:
        self.kills.append(ReplicaKill(iteration, after_s))
        return self

    def arm(self, iteration: int, busy: BusyReplicas) -> threading.Thread | None:
        """A started thread that carries out the kills due at `iteration`, each on a replica `busy`
        reports and none killed before (None when no kill is due)."""
        due = [k for k in self.kills if k.iteration == iteration]
        if not due:
            return None
        thread = threading.Thread(target=self._fire, args=(iteration, due, busy), daemon=True)
        thread.start()
        return thread

    def _fire(self, iteration: int, due: list[ReplicaKill], busy: BusyReplicas) -> None:
        killed: list[int] = []
        for kill in due:
            pid = busy.wait_for_one(START_TIMEOUT_S, besides=killed)
            if pid is None:
                return  # no replica began a group: the rollout fails or ends on its own
            time.sleep(kill.after_s)
            os.kill(pid, signal.SIGKILL)
            killed.append(pid)
            self.fired.append({"iteration": iteration, "pid": pid, "at": time.time()})


def replica_pids(app_name: str) -> list[int]:
    """Process ids of the application's live replicas, to kill one; RuntimeError when there is none."""
    pids = live_replica_pids(app_name)
    if not pids:
        raise RuntimeError(f"no live replica of application {app_name!r} to kill")
    return pids


def live_replica_pids(app_name: str, on_node: str | None = None) -> list[int]:
    """Process ids of the application's live replicas (on Ray node `on_node` only, if given), possibly
    none (this node's Ray state API: the test clusters' processes all run here)."""
    from ray.util.state import list_actors

    from baige_ray.api.connection import state_api_address

    actors = list_actors(address=state_api_address(), filters=[("state", "=", "ALIVE")], limit=10_000)
    return sorted(a.pid for a in actors if a.class_name.startswith(f"ServeReplica:{app_name}:")
                  and (on_node is None or a.node_id == on_node))
