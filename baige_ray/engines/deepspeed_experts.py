"""Expert parallelism beside DeepSpeed ZeRO-1/2, through DeepSpeed's own MoE parameter groups.

ZeRO reduces and partitions a parameter over its expert-data-parallel group instead of the whole
data-parallel group when the parameter says so (`allreduce=False`, `group_name="ep_size_<ep>"`),
the client optimizer holds such parameters in groups marked `moe`, and the engine has seen a
DeepSpeed `MoE` module: only then does it create the expert groups (through the module's
`set_deepspeed_parallelism`) and hand them to ZeRO. It then averages expert gradients over edp
with the data-parallel degree as divisor, and takes the expert partitions' norms into the clipping
norm, which is exactly what one process holding the whole batch computes.

Our MoE layers route tokens themselves (models/moe.py), so DeepSpeed is shown `ExpertGroups`, a
`MoE` that holds no layer: it states the expert count and creates DeepSpeed's groups. DeepSpeed's
layout of them is the layout's own (consecutive ranks form an expert group; ranks `ep` apart hold
the same experts), and `check_same_expert_groups` verifies that after initialization.

Each rank keeps its slice of every expert tensor as a plain parameter (ZeRO flattens plain
tensors, not DTensors); `ExpertShards` cuts canonical tensors into those slices and gathers them back.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from deepspeed.moe.layer import MoE
from deepspeed.utils import groups
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor


def expert_group_name(ep: int) -> str:
    return f"ep_size_{ep}"  # DeepSpeed's own naming: the group dictionaries are keyed by it


class ExpertGroups(MoE):
    """Tells DeepSpeed's engine the model has experts sharded `ep` ways, and creates its expert groups."""

    def __init__(self, num_experts: int, ep: int):
        nn.Module.__init__(self)  # not MoE.__init__, which would build DeepSpeed's own gate and experts
        self.num_experts, self.ep_size = num_experts, ep
        self.expert_group_name = expert_group_name(ep)

    def set_deepspeed_parallelism(self, use_data_before_expert_parallel_: bool = False) -> None:
        if use_data_before_expert_parallel_:
            raise ValueError("use_data_before_expert_parallel_ is not supported: expert groups are consecutive ranks")
        if self.expert_group_name not in groups._get_expert_parallel_group_dict():
            groups._create_expert_and_data_parallel(self.ep_size)

    def forward(self, *args, **kwargs):
        raise RuntimeError("ExpertGroups holds no layer: the model's own MoE layers route tokens")


class WithExpertGroups(nn.Module):
    """The model as DeepSpeed sees it: the same forward, plus `ExpertGroups` among its modules."""

    def __init__(self, model: nn.Module, expert_groups: ExpertGroups):
        super().__init__()
        self.model = model
        self.expert_groups = expert_groups

    def forward(self, *args, **kwargs):
        return self.model(*args, **kwargs)


class ExpertShards:
    """This rank's slices of the expert tensors: marked for DeepSpeed, cut from and gathered into canonical form."""

    def __init__(self, model: nn.Module, expert_layers: list[nn.Module], ep_mesh: DeviceMesh):
        self.group = ep_mesh.get_group()
        self.ep, self.ep_rank = ep_mesh.size(), ep_mesh.get_local_rank()
        sliced: set[int] = set()
        for layer in expert_layers:
            layer.enable_expert_parallel(ep_mesh)
            sliced.update(id(param) for param in _keep_local_slices(layer, expert_group_name(self.ep)))
        self.names = {name for name, param in model.named_parameters() if id(param) in sliced}

    def cut(self, name: str, full: torch.Tensor) -> torch.Tensor:
        """The slice of a canonical tensor this rank holds (experts by index); other tensors whole."""
        return full.chunk(self.ep)[self.ep_rank] if name in self.names else full

    def gather(self, name: str, local: torch.Tensor) -> torch.Tensor:
        """Collective over the expert group for expert tensors: every expert, by index."""
        if name not in self.names:
            return local
        parts = [torch.empty_like(local) for _ in range(self.ep)]
        dist.all_gather(parts, local.contiguous(), group=self.group)
        return torch.cat(parts)

    def check_same_expert_groups(self) -> None:
        """DeepSpeed's expert group must be the ranks our layers exchange tokens with."""
        theirs = dist.get_process_group_ranks(groups._get_expert_parallel_group(expert_group_name(self.ep)))
        ours = dist.get_process_group_ranks(self.group)
        if sorted(theirs) != sorted(ours):
            raise RuntimeError(f"DeepSpeed's expert group {theirs} differs from the layout's {ours}")


def _keep_local_slices(layer: nn.Module, group_name: str) -> list[nn.Parameter]:
    """Replace each DTensor parameter of `layer` by a plain one holding this rank's slice, marked as
    DeepSpeed marks expert parameters; return the new parameters."""
    sliced = []
    for module in layer.modules():
        for name, param in list(module.named_parameters(recurse=False)):
            if isinstance(param, DTensor):
                local = nn.Parameter(param.to_local().detach().clone(), requires_grad=param.requires_grad)
                local.allreduce, local.group_name = False, group_name
                setattr(module, name, local)
                sliced.append(local)
    return sliced
