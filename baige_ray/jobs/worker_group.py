"""The Ray layer under `fit`: a placement group, one worker actor per bundle, process-group generations.

Ranks follow device locality (node, then device index), so neighbouring ranks
share a node whatever order Ray returned the bundles in.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from baige_ray.actors.worker import WorkerActor
from baige_ray.api.configs import ScalingConfig
from baige_ray.api.device import DeviceInfo
from baige_ray.api.errors import ClusterError, WorkerError
from baige_ray.engines.host_allocator import worker_runtime_env
from baige_ray.parallel.distributed import GroupMembership
from baige_ray.planner.materialize import MaterializedPlan
from baige_ray.runtime.resources import choose_device_resource, worker_bundle


class WorkerGroup:
    """N worker actors in one placement group. Call `shutdown()` when done."""

    def __init__(
        self,
        scaling: ScalingConfig,
        *,
        worker_cls: type = WorkerActor,
        timeout_s: float = 300.0,
        placement: MaterializedPlan | None = None,
    ):
        """Without `placement`, one placement group of `num_workers` bundles and ranks ordered by
        locality; with it, rank r runs where the planner put rank r."""
        self.scaling = scaling
        self.timeout_s = timeout_s
        self.generation = -1
        self.resource = choose_device_resource(scaling, ray.cluster_resources())
        self._placement = placement
        self._placement_group = None if placement else self._build_placement_group()
        self.workers = self._build_workers(worker_cls)
        self.device_infos = self._order_by_locality() if placement is None else self._device_infos()

    def _build_placement_group(self):
        bundles = [worker_bundle(self.scaling, self.resource) for _ in range(self.scaling.num_workers)]
        group = placement_group(bundles, strategy=self.scaling.placement_strategy)
        try:
            ray.get(group.ready(), timeout=self.scaling.placement_timeout_s)
        except GetTimeoutError:
            remove_placement_group(group)
            wanted = sorted(bundles[0])
            available = {name: ray.available_resources().get(name, 0.0) for name in wanted}
            raise ClusterError(
                f"the job needs {len(bundles)} x {bundles[0]} ({self.scaling.placement_strategy}); "
                f"not placed within {self.scaling.placement_timeout_s:g}s, available now: {available}"
            ) from None
        return group

    def _build_workers(self, worker_cls: type) -> list[ray.actor.ActorHandle]:
        remote_cls = ray.remote(worker_cls)  # single-threaded: see ELASTIC_WORKER_THREADS
        bundle = worker_bundle(self.scaling, self.resource)
        custom = {name: amount for name, amount in bundle.items() if name not in ("CPU", "GPU")}
        if self._placement is not None:
            # The planner's bundles carry their own CPU share; the actor takes what its bundle holds.
            bundle = dict(self._placement.layout.groups[0].bundles[0])
            custom = {}
        return [
            remote_cls.options(
                num_cpus=bundle.get("CPU", 0.0),
                num_gpus=bundle.get("GPU", 0.0),
                resources=custom,
                scheduling_strategy=self._scheduling_strategy(index),
                runtime_env=worker_runtime_env(self.scaling.host_allocator),
            ).remote(cpu_niceness=self.scaling.cpu_niceness)
            for index in range(self.scaling.num_workers)
        ]

    def _scheduling_strategy(self, rank: int) -> PlacementGroupSchedulingStrategy:
        if self._placement is not None:
            return self._placement.scheduling_strategy(rank)
        return PlacementGroupSchedulingStrategy(
            placement_group=self._placement_group, placement_group_bundle_index=rank
        )

    def _device_infos(self) -> list[DeviceInfo]:
        return self._get([worker.device_info.remote() for worker in self.workers], "device_info")

    def _order_by_locality(self) -> list[DeviceInfo]:
        infos = self._device_infos()
        order = sorted(range(len(infos)), key=lambda i: infos[i].location)
        self.workers = [self.workers[i] for i in order]
        return [infos[i] for i in order]

    @property
    def num_workers(self) -> int:
        return len(self.workers)

    def form_process_group(self) -> int:
        """Join every worker into a new generation; returns the generation number."""
        self.generation += 1
        store = self._get([self.workers[0].host_store.remote(self.device_infos[0].node_ip)], "host_store")[0]
        memberships = [
            GroupMembership(store=store, rank=rank, world_size=self.num_workers, generation=self.generation)
            for rank in range(self.num_workers)
        ]
        self.call_each("join_group", memberships)
        return self.generation

    def call(self, method: str, *args: Any) -> list[Any]:
        """Call `method(*args)` on every worker at once and wait for all of them."""
        return self._get([getattr(worker, method).remote(*args) for worker in self.workers], method)

    def submit(self, method: str, *args: Any) -> list:
        """Start `method(*args)` on every worker; `collect` waits for the results."""
        return [getattr(worker, method).remote(*args) for worker in self.workers]

    def collect(self, refs: list, method: str, timeout_s: float | None = None) -> list[Any]:
        """The results of `submit`; waits `timeout_s` (default: this group's timeout)."""
        return self._get(refs, method, timeout_s=timeout_s)

    def call_each(self, method: str, per_rank_args: Sequence[Any]) -> list[Any]:
        """Call `method` on every worker with its own arguments (a tuple spreads into several)."""
        refs = [
            getattr(worker, method).remote(*(args if isinstance(args, tuple) else (args,)))
            for worker, args in zip(self.workers, per_rank_args, strict=True)
        ]
        return self._get(refs, method)

    def _get(self, refs: list, method: str, ranks: Sequence[int] | None = None,
             timeout_s: float | None = None) -> list[Any]:
        ranks = list(ranks) if ranks is not None else list(range(len(refs)))
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        try:
            return ray.get(refs, timeout=timeout_s)
        except GetTimeoutError:
            ready, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
            stuck = [rank for rank, ref in zip(ranks, refs) if ref not in ready]
            raise WorkerError(stuck[0], f"{method} did not finish within {timeout_s:.0f}s (ranks {stuck})") from None
        except (RayActorError, RayTaskError) as error:
            failed = self._first_failed_rank(refs, ranks)
            raise WorkerError(failed, f"{method} failed: {error}") from error

    @staticmethod
    def _first_failed_rank(refs: list, ranks: list[int]) -> int:
        for rank, ref in zip(ranks, refs):
            try:
                ray.get(ref, timeout=0)
            except GetTimeoutError:
                continue
            except Exception:  # the failing rank is the one whose own result raises
                return rank
        return ranks[0]

    def shutdown(self) -> None:
        for worker in self.workers:
            ray.kill(worker, no_restart=True)
        self.workers = []
        if self._placement is not None:
            self._placement.release()
        else:
            remove_placement_group(self._placement_group)
