"""The Ray side of expert-parallel serving: a replica's expert ranks as actors in one process group.

The replica (rank 0) hosts the rendezvous store, starts `ranks - 1` `ExpertServer` actors on its own
node where it can (expert traffic crosses every MoE layer of every forward), joins them in a
process group and puts an `ExpertDispatcher` on its model's expert layers. The actors are owned by
the replica: they go when it goes.
"""

from __future__ import annotations

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
from torch import nn

from baige_ray.parallel.distributed import GroupMembership, ProcessGroupMember, RendezvousAbandoned
from baige_ray.serving.expert_parallel import ExpertDispatcher, ExpertParallelServing, layer_specs

# Expert ranks wait for the next forward inside a collective for as long as the replica is idle;
# the process group's timeout must not end that wait (the replica stops them explicitly).
IDLE_TIMEOUT_S = 365 * 24 * 3600.0


class ExpertRanks:
    def __init__(self, layers: list[nn.Module], options: ExpertParallelServing, actor_options: dict):
        from baige_ray.serving.expert_server import ExpertServer

        if not layers:
            raise ValueError("expert-parallel serving needs a mixture-of-experts model: this one has no expert layers")
        specs = layer_specs(layers)
        backend = "nccl" if next(iter(layers[0].expert_weights().values())).is_cuda else "gloo"
        self._member = ProcessGroupMember(backend, timeout_s=IDLE_TIMEOUT_S)
        store = self._member.host_store(ray.util.get_node_ip_address())
        here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=True)
        self._actors = [ray.remote(ExpertServer).options(**actor_options, scheduling_strategy=here).remote()
                        for _ in range(options.ranks - 1)]
        self._loops = [actor.serve.remote(GroupMembership(store, rank, options.ranks, 0), backend, IDLE_TIMEOUT_S,
                                          specs, options) for rank, actor in enumerate(self._actors, start=1)]
        try:
            self._member.join(GroupMembership(store, 0, options.ranks, 0), abandoned=self._an_expert_rank_ended)
        except RendezvousAbandoned:
            ray.get(self._loops)  # raises what ended the expert rank
            raise
        self.dispatcher = ExpertDispatcher(layers, options)

    def _an_expert_rank_ended(self) -> bool:
        ready, _ = ray.wait(self._loops, num_returns=1, timeout=0)
        return bool(ready)

    def stats(self) -> dict:
        return self.dispatcher.stats()

    def close(self, timeout_s: float = 30.0) -> list[int]:
        """Stop the expert ranks (the model computes its experts itself again); returns the forwards each served."""
        self.dispatcher.close()
        try:
            return ray.get(self._loops, timeout=timeout_s)
        finally:
            self._member.leave()
            for actor in self._actors:
                ray.kill(actor)
