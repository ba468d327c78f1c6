"""Mixture-of-experts Hugging Face models (Mixtral, Qwen2-MoE, Qwen3-MoE): expert parallelism and the router loss.

transformers holds each MoE layer's experts as two tensors indexed by expert
(`mlp.experts.gate_up_proj`: E x 2F x H, `mlp.experts.down_proj`: E x H x F) beside a router
(`mlp.gate`) that returns (logits, top-k weights, top-k indices). `RoutedExperts` takes the
experts module's place with the same parameters under the same names and the same call, and
computes exactly what transformers' experts compute, through `route_to_experts`
(models/moe.py): all experts here, or, once `enable_expert_parallel` sharded them by expert index,
tokens exchanged with their experts' ranks by all-to-all. The rest of the block (router, Qwen2-MoE's
gated shared expert) stays transformers' own.

The load-balancing loss is the model's own `load_balancing_loss_func` (Switch Transformer's, over
the router logits of every layer of a forward) times `router_aux_loss_coef`, added when the config
says `output_router_logits`, as transformers' forward adds it. Being one mean over all layers'
routing, it couples the layers, so it cannot be split over pipeline stages (plugin.check_layout).
Under data parallelism each rank computes it on its own micro-batch, as transformers does on
each device. Under context parallelism a micro-batch's sequences are split over the CP group, so the
ranks count the whole sequences' routing together and each adds its own tokens' share of the loss
(`split_sequence_balance_loss`): the group's sum is the loss one process computes on the whole sequences.
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from baige_ray.models.aux_loss import attach_auxiliary_loss
from baige_ray.models.moe import ExpertTraffic, LocalExperts, route_to_experts
from baige_ray.parallel import context_parallel
from baige_ray.parallel.distributed import all_reduce_abortable

MOE_ARCHITECTURES = ("MixtralForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM")
EXPERT_COUNT_KEYS = ("num_local_experts", "num_experts")  # config.json files and transformers' to_dict differ


class RoutedExperts(nn.Module):
    """transformers' fused experts (same parameter names, same call), able to shard by expert index."""

    def __init__(self, experts: nn.Module):
        super().__init__()
        self.gate_up_proj = experts.gate_up_proj  # E x 2F x H: gate rows, then up rows
        self.down_proj = experts.down_proj  # E x H x F
        self.act_fn = experts.act_fn
        self.num_experts = int(experts.gate_up_proj.shape[0])
        self.expert_group: dist.ProcessGroup | None = None
        self.traffic = ExpertTraffic()
        self.expert_runner: LocalExperts | None = None  # set by expert-parallel serving: where slots go instead

    def expert_weights(self) -> dict[str, torch.Tensor]:
        """The experts' tensors, whole and indexed by expert, as `expert_kernel` takes them."""
        return {"gate_up_proj": self.gate_up_proj.detach(), "down_proj": self.down_proj.detach()}

    def expert_kernel(self) -> GatedExpertKernel:
        return GatedExpertKernel(self.act_fn)

    def run_experts_with(self, runner: LocalExperts | None) -> None:
        """Hand the routed slots (grouped by expert) to `runner`; None: compute them here again."""
        self.expert_runner = runner

    def enable_expert_parallel(self, ep_mesh: DeviceMesh) -> None:
        from torch.distributed.tensor import Shard, distribute_tensor

        for name in ("gate_up_proj", "down_proj"):
            full = getattr(self, name)
            setattr(self, name, nn.Parameter(distribute_tensor(full.detach(), ep_mesh, [Shard(0)], src_data_rank=None)))
        self.expert_group = ep_mesh.get_group()

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
        runner, group = (self.expert_runner, None) if self.expert_runner is not None else (self._run_local, self.expert_group)
        out, _ = route_to_experts(hidden_states, top_k_index, top_k_weights, runner,
                                  num_experts=self.num_experts, group=group, traffic=self.traffic)
        return out

    def _run_local(self, rows: torch.Tensor, counts: list[int]) -> torch.Tensor:
        weights = {"gate_up_proj": _local(self.gate_up_proj), "down_proj": _local(self.down_proj)}
        return GatedExpertKernel(self.act_fn)(weights, rows, counts)


class GatedExpertKernel:
    """transformers' gated experts on given weights (one row per expert held), so that a process holding
    only some experts' weights (an expert rank of expert-parallel serving) runs them."""

    def __init__(self, act_fn: nn.Module):
        self.act_fn = act_fn

    def __call__(self, weights: dict[str, torch.Tensor], rows: torch.Tensor, counts: list[int]) -> torch.Tensor:
        gate_up, down = weights["gate_up_proj"], weights["down_proj"]
        outputs = []
        # Empty chunks too: the output must stay in the autograd graph when no token came (models/moe.py).
        for expert, chunk in enumerate(rows.split(counts)):
            gate, up = F.linear(chunk, gate_up[expert]).chunk(2, dim=-1)
            outputs.append(F.linear(self.act_fn(gate) * up, down[expert]))
        return torch.cat(outputs)


def _local(tensor: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def install_routed_experts(layers: list[nn.Module]) -> None:
    """Put a `RoutedExperts` in place of each MoE layer's transformers experts (dense layers have none)."""
    for layer in layers:
        experts = getattr(layer.mlp, "experts", None)  # transformers' module tree: only MoE layers have experts
        if experts is not None and not isinstance(experts, RoutedExperts):
            layer.mlp.experts = RoutedExperts(experts)


def routed_experts(layers: list[nn.Module]) -> list[RoutedExperts]:
    """The `RoutedExperts` of `layers`, in layer order."""
    return [layer.mlp.experts for layer in layers if isinstance(getattr(layer.mlp, "experts", None), RoutedExperts)]


class RouterBalanceLoss:
    """Collects the router logits of a forward over some layers, then attaches transformers' own
    load-balancing loss (times `coef`) to the forward's output."""

    def __init__(self, causal_lm_type: type, layers: list[nn.Module], *, num_experts: int, top_k: int, coef: float):
        self._loss = sys.modules[causal_lm_type.__module__].load_balancing_loss_func
        self.num_experts, self.top_k, self.coef = num_experts, top_k, coef
        self._logits: list[torch.Tensor] = []
        for layer in layers:
            if isinstance(getattr(layer.mlp, "experts", None), RoutedExperts):
                layer.mlp.gate.register_forward_hook(self._record)

    def _record(self, module: nn.Module, inputs, output) -> None:
        if torch.is_grad_enabled():
            self._logits.append(output[0])

    def attach(self, output: torch.Tensor) -> torch.Tensor:
        logits, self._logits = self._logits, []
        if not logits:
            return output
        context = context_parallel.active()
        if context is None:
            loss = self._loss(tuple(logits), self.num_experts, self.top_k)
        else:
            loss = split_sequence_balance_loss(logits, self.num_experts, self.top_k, context.group)
        return attach_auxiliary_loss(output, self.coef * loss)


def split_sequence_balance_loss(logits: list[torch.Tensor], num_experts: int, top_k: int,
                                group: dist.ProcessGroup) -> torch.Tensor:
    """This rank's share of transformers' `load_balancing_loss_func` over sequences split across `group`
    (context parallelism): the shares sum, over the group, to the loss of the whole sequences.

    The loss is E x sum_e (T_e / N) (P_e / N): T_e the top-k assignments to expert e, P_e the summed router
    probabilities, N the rows, each summed over every layer's rows. T and N count the whole sequences
    (summed over the group, no gradient flows through a count); each rank's P is its own tokens', so the
    shares' gradients are the whole loss's."""
    assignments = torch.zeros(num_experts, dtype=torch.float32, device=logits[0].device)
    probability = torch.zeros(num_experts, dtype=torch.float32, device=logits[0].device)
    rows = 0
    for layer_logits in logits:
        routing = F.softmax(layer_logits, dim=-1)
        _, chosen = torch.topk(routing, top_k, dim=-1)
        assignments += torch.bincount(chosen.reshape(-1), minlength=num_experts).float()
        probability = probability + routing.float().sum(dim=0)
        rows += routing.shape[0]
    counts = torch.cat([assignments, torch.tensor([float(rows)], device=assignments.device)])
    all_reduce_abortable(counts, group)
    whole_assignments, whole_rows = counts[:-1], counts[-1]
    return num_experts * torch.sum(whole_assignments / whole_rows * (probability / whole_rows))


def moe_shape(config: dict, architecture: str) -> tuple[int, int] | None:
    """(experts, top-k) of an MoE architecture's config; None for a dense one."""
    if architecture not in MOE_ARCHITECTURES:
        return None
    count = next((config[key] for key in EXPERT_COUNT_KEYS if config.get(key) is not None), None)
    if count is None:
        raise ValueError(f"the {architecture} config has no expert count: expected one of {list(EXPERT_COUNT_KEYS)}")
    return int(count), int(config["num_experts_per_tok"])


def router_loss_coef(config: dict) -> float:
    """The coefficient transformers' forward gives the load-balancing loss (0 when it adds none)."""
    if not config.get("output_router_logits", False):
        return 0.0
    return float(config.get("router_aux_loss_coef", 0.0))

