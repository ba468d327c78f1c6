"""Apply tensor and data parallelism to a stage module, torchtitan style.

TP shards each block by the model plug-in's plan with DTensor (Megatron-LM's scheme:
attention and MLP input projections column-wise, output projections row-wise, one
all-reduce per sub-layer forward). DP is DDP, FSDP2 (`fully_shard` per block, then the root) or, when
DTensor parameters rule DDP out, an explicit all-reduce of gradients over the
data-parallel group after backward.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.nn.parallel import DistributedDataParallel

from baige_ray.parallel.boxes import is_dtensor
from baige_ray.parallel.distributed import abortable_mean_hook, all_reduce_abortable
from baige_ray.parallel.subgroups import device_mesh, flattened, subgroup


def apply_activation_recomputation(blocks: list[nn.Module]) -> None:
    """Each block keeps its input alone for backward and runs its forward again there (non-reentrant
    checkpointing through torch's composable API: parameter names stay as they are, and FSDP2's
    `fully_shard` composes with it, as torchtitan applies them: TP, then recomputation, then FSDP)."""
    from torch.distributed._composable import checkpoint

    for block in blocks:
        checkpoint(block)


def apply_tensor_parallel(blocks: list[nn.Module], tp_mesh: DeviceMesh, plan: dict) -> None:
    """Parallelize each block by the model's plan (DTensor styles keyed by block-relative module name)."""
    from torch.distributed.tensor.parallel import parallelize_module  # DTensor: imported where it is used

    for block in blocks:
        parallelize_module(block, tp_mesh, plan)


def apply_expert_parallel(expert_modules: list[nn.Module], ep_mesh: DeviceMesh) -> None:
    """Shard each expert layer's experts by expert index over `ep_mesh` (see models/moe.py)."""
    for module in expert_modules:
        module.enable_expert_parallel(ep_mesh)


def apply_fsdp(stage: nn.Module, blocks: list[nn.Module], dp_mesh: DeviceMesh,
               ignored: set[nn.Parameter] = frozenset(), compute_dtype: torch.dtype | None = None) -> None:
    """Shard each block, then the rest of the stage, over `dp_mesh`; `ignored` parameters (experts
    already sharded by expert parallelism) stay as they are, their gradients reduced by the engine.
    With `compute_dtype` (mixed precision) weights are gathered in it; gradients reduce in fp32."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from baige_ray.engines.host_reduce_scatter import HostReduceScatter

    policy = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32) if compute_dtype \
        else MixedPrecisionPolicy()
    modules = [*blocks, stage]
    for module in modules:
        fully_shard(module, mesh=dp_mesh, ignored_params=set(ignored) or None, mp_policy=policy)
    if dp_mesh.device_type == "cpu":
        reduce_scatter = HostReduceScatter()
        for module in modules:
            module.set_custom_reduce_scatter(reduce_scatter)


def _abortable(model: DistributedDataParallel, dp_group: dist.ProcessGroup,
               on_accelerator: bool) -> DistributedDataParallel:
    """On gloo, buckets a lost peer's abort releases (parallel/distributed.py: abortable_mean_hook)."""
    if not on_accelerator:
        model.register_comm_hook(dp_group, abortable_mean_hook)
    return model


def apply_ddp(stage: nn.Module, dp_group: dist.ProcessGroup, on_accelerator: bool,
              zero_loss: Callable[[nn.Module], torch.Tensor] | None = None) -> nn.Module:
    """Wrap `stage` in DDP; `zero_loss(module)` (a loss times zero on one tiny batch) settles its buckets.

    DDP buckets its first step's gradients in registration order, then re-buckets them by their
    backward order for good. A group re-formed mid-run would reduce its first step in the other layout
    (elements fall into other ring chunks: 1-ulp differences from the uninterrupted run). One throwaway
    synchronised backward of `zero_loss` at construction makes every real step use the settled layout,
    so recovery stays bitwise without DDP's per-step unused-parameter search. Without `zero_loss`, or
    when some parameter gets no gradient (DDP then needs that search), find_unused_parameters keeps the
    construction-time layout for good instead.
    """
    options = dict(process_group=dp_group, device_ids=[0] if on_accelerator else None,
                   broadcast_buffers=_forward_changes_buffers(stage))
    if zero_loss is None or not _every_parameter_gets_a_gradient(stage, zero_loss):
        return _abortable(DistributedDataParallel(stage, find_unused_parameters=True, **options), dp_group,
                          on_accelerator)
    model = _abortable(DistributedDataParallel(stage, **options), dp_group, on_accelerator)
    zero_loss(model).backward()
    stage.zero_grad(set_to_none=True)
    return model


def _forward_changes_buffers(stage: nn.Module) -> bool:
    """Whether `stage` has buffers kept in its state dict (batch norm's running statistics, which a forward
    updates): DDP then broadcasts rank 0's before every forward, a collective per micro-batch. A
    transformer's buffers are constants derived from its config and left out of the state dict (rotary
    frequencies): equal on every rank, broadcast for nothing (a twentieth of a tiny model's step)."""
    saved = set(stage.state_dict(keep_vars=True))
    return any(name in saved for name, _ in stage.named_buffers())


def _every_parameter_gets_a_gradient(stage: nn.Module, zero_loss: Callable[[nn.Module], torch.Tensor]) -> bool:
    zero_loss(stage).backward()
    used = all(param.grad is not None for param in stage.parameters() if param.requires_grad)
    stage.zero_grad(set_to_none=True)
    return used


def local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if is_dtensor(tensor) else tensor


def settle_gradient_placements(parameters: list[nn.Parameter]) -> None:
    """Lay each DTensor gradient out as its parameter is. A vocabulary-parallel embedding's backward
    leaves its weight's gradient Partial (whole-sized, summed over TP on demand) while the weight is
    Shard(0); collectives on local shards and norms need the parameter's layout."""
    for param in parameters:
        grad = param.grad
        if is_dtensor(grad) and grad.placements != param.placements:
            param.grad = grad.redistribute(param.device_mesh, param.placements)


def all_reduce_gradients(parameters: list[nn.Parameter], group: dist.ProcessGroup | None, *,
                         divide_by: int | None = None) -> None:
    """Sum gradients over `group` (None: this rank alone) in one flat collective, then divide them by
    `divide_by` (default: the group's size, an average)."""
    grads = [local(p.grad) for p in parameters if p.grad is not None]
    if not grads:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    if group is not None:
        all_reduce_abortable(flat, group)
    divisor = divide_by if divide_by is not None else (dist.get_world_size(group) if group is not None else 1)
    if divisor != 1:
        flat /= divisor
    offset = 0
    for grad in grads:
        grad.copy_(flat[offset : offset + grad.numel()].view_as(grad))
        offset += grad.numel()


def _sharded_mesh_dims(tensor: torch.Tensor) -> tuple:
    """(mesh, dims over which the tensor is sharded); replicated dims hold identical copies. Any placement
    but Replicate (or a Partial not yet reduced) splits the tensor: FSDP2 over a TP-sharded dimension lays
    it out as `_StridedShard`, which torch 2.13 does not count as `is_shard()`."""
    if not is_dtensor(tensor):
        return (None, ())
    dims = tuple(i for i, placement in enumerate(tensor.placements)
                 if not (placement.is_replicate() or placement.is_partial()))
    return (tensor.device_mesh, dims)


def _dim_names(mesh: DeviceMesh | None) -> tuple[str, ...]:
    return tuple(mesh.mesh_dim_names or ()) if mesh is not None else ()


def global_grad_norm(parameters: list[nn.Parameter], pp_group: dist.ProcessGroup | None) -> float:
    """The norm a single process holding the whole model would compute.

    Squared norms of local shards are summed per sharding pattern and all-reduced
    once per sharded mesh dimension (not once per parameter), counted once where
    replicated, then summed over pipeline stages.
    """
    grads_by_pattern: dict[tuple, list[torch.Tensor]] = {}
    for param in parameters:
        if param.grad is not None:
            grads_by_pattern.setdefault(_sharded_mesh_dims(param.grad), []).append(local(param.grad).detach())
    by_pattern = {key: _sum_of_squares(grads) for key, grads in grads_by_pattern.items()}
    total = torch.zeros((), dtype=torch.float64)
    # the same order on every rank, so the collectives pair up
    for (mesh, dims), square in sorted(by_pattern.items(), key=lambda item: (item[0][1], _dim_names(item[0][0]))):
        for dim in dims:
            all_reduce_abortable(square, mesh.get_group(dim))
        total += square
    if pp_group is not None and dist.get_world_size(pp_group) > 1:
        all_reduce_abortable(total, pp_group)
    return float(total.sqrt())


def _sum_of_squares(grads: list[torch.Tensor]) -> torch.Tensor:
    """Sum of squared entries in float64 (reduced per tensor in float64, no float64 copies made)."""
    norms = torch.stack([torch.linalg.vector_norm(grad, dtype=torch.float64) for grad in grads])
    return norms.square().sum().cpu()


def clip_grad_norm(parameters: list[nn.Parameter], max_norm: float, pp_group: dist.ProcessGroup | None,
                   duplicates: list[nn.Parameter] = ()) -> float:
    """Scale gradients so their global norm is at most `max_norm`; returns the norm before clipping.
    `duplicates` (copies of parameters another pipeline stage holds too) are scaled but not counted."""
    copies = {id(param) for param in duplicates}
    total = global_grad_norm([param for param in parameters if id(param) not in copies], pp_group)
    coefficient = min(1.0, max_norm / (total + 1e-6))
    if coefficient < 1.0:
        grads = [param.grad for param in parameters if param.grad is not None]
        for same_kind in ([g for g in grads if is_dtensor(g)], [g for g in grads if not is_dtensor(g)]):
            if same_kind:  # one fused kernel per kind: DTensor dispatches foreach ops only on DTensor lists
                torch._foreach_mul_(same_kind, coefficient)
    return total


def pipeline_ends_group(world_size: int, pp: int, rank: int) -> dist.ProcessGroup | None:
    """The group of `rank`'s first- and last-stage peers: pp ranks 0 and pp - 1 at the same data- and
    tensor-parallel coordinates (ranks are row-major over (pp, rest)); None for a middle stage's rank.
    Collective: every rank creates every pair's group, in the same order."""
    per_stage = world_size // pp
    mine = None
    for offset in range(per_stage):
        pair = [offset, (pp - 1) * per_stage + offset]
        group = subgroup(pair)
        if rank in pair:
            mine = group
    return mine


def sliced_meshes(device_type: str, sizes: dict[str, int]) -> dict[str, DeviceMesh]:
    """`sizes`' dimensions of more than one rank as slices of one device mesh; with "edp" and "ep",
    "dp" is the two together (the ranks all-reducing dense gradients). "replicas" is the ranks holding the
    same weights, whose gradients are reduced together: dp, and with context parallelism dp x cp.
    "expert_replicas" is the ranks holding the same experts: edp, and with context parallelism edp x cp."""
    multi = {name: size for name, size in sizes.items() if size > 1}
    mesh = device_mesh(device_type, tuple(multi.values()), tuple(multi))
    meshes = {name: mesh[name] for name in multi}
    data_dims = [name for name in ("dp", "edp", "ep") if name in multi]
    if "edp" in meshes:
        meshes["dp"] = flattened(mesh["edp", "ep"], "dp")
    elif "ep" in meshes:
        meshes["dp"] = meshes["ep"]  # one replica per expert group: the expert group is the data-parallel group
    if "cp" in meshes:
        meshes["replicas"] = flattened(mesh[(*data_dims, "cp")], "replicas") if data_dims else meshes["cp"]
    elif "dp" in meshes:
        meshes["replicas"] = meshes["dp"]
    if "ep" in multi:
        expert_dims = [name for name in ("edp", "cp") if name in multi]
        if len(expert_dims) == 2:
            meshes["expert_replicas"] = flattened(mesh["edp", "cp"], "expert_replicas")
        elif expert_dims:
            meshes["expert_replicas"] = meshes[expert_dims[0]]
    return meshes
