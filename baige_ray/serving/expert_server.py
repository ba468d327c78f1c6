"""ExpertServer: one expert rank of an expert-parallel serving replica (serving/expert_parallel.py).

It joins the replica's process group and then answers the replica's MoE layers until told to stop:
it holds only the expert weights of the slots the replica places on it.
"""

from __future__ import annotations

from baige_ray.parallel.distributed import GroupMembership, ProcessGroupMember
from baige_ray.serving.expert_parallel import ExpertLayerSpec, ExpertParallelServing, serve_experts


class ExpertServer:
    def __init__(self) -> None:
        import torch

        torch.set_num_threads(1)  # expert ranks share cores with the replica and training workers

    def serve(self, membership: GroupMembership, backend: str, timeout_s: float, specs: list[ExpertLayerSpec],
              options: ExpertParallelServing) -> int:
        """Join the group, serve the experts until the replica stops them; returns the layer forwards served."""
        member = ProcessGroupMember(backend, timeout_s=timeout_s)
        member.join(membership)
        try:
            return serve_experts(specs, options, device="cuda" if backend == "nccl" else "cpu")
        finally:
            member.leave()
