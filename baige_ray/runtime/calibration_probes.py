"""Probes a worker actor runs for `baige-ray calibrate`: compute, collectives, overlap, optimizer.

Every probe runs in all workers of one process group at once (gloo on CPU, NCCL on GPU, the
same code), so that devices sharing a host's cores or a node's links are measured as they
run during training. Results are plain numbers; fitting them is the planner's job
(planner/calibration.py).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F

from baige_ray.planner.model_spec import ModelSpec

DTYPES = {2: torch.bfloat16, 4: torch.float32}


def _timed(run: Callable[[], None], repeats: int, device: str) -> float:
    """Median seconds of `run` after one warm-up, every repeat started together on all ranks."""
    run()
    samples = []
    for _ in range(repeats):
        dist.barrier()
        _sync(device)
        start = time.perf_counter()
        run()
        _sync(device)
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


# ---- compute -------------------------------------------------------------------------------------


class _LocalBlock(torch.nn.Module):
    """One decoder layer's local shard under TP degree `tp`: the GEMM shapes a rank runs."""

    def __init__(self, model: ModelSpec, tp: int):
        super().__init__()
        h, q, kv = model.hidden, model.q_dim // tp, model.kv_dim // tp
        ffn = (model.top_k * model.expert_ffn + model.shared_expert_ffn if model.is_moe else model.ffn_hidden) // tp
        self.heads, self.kv_heads, self.head_size = model.num_heads // tp, model.kv_heads // tp, model.head_size
        norm = torch.nn.RMSNorm if model.rms_norm else torch.nn.LayerNorm
        self.norm1, self.norm2 = norm(h), norm(h)
        self.qkv = torch.nn.Linear(h, q + 2 * kv, bias=False)
        self.out = torch.nn.Linear(q, h, bias=False)
        self.gated = model.gated_mlp
        self.up = torch.nn.Linear(h, (2 if self.gated else 1) * ffn, bias=False)
        self.down = torch.nn.Linear(ffn, h, bias=False)
        self.q_width, self.kv_width = q, kv

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = self.qkv(self.norm1(x)).split([self.q_width, self.kv_width, self.kv_width], dim=-1)
        q = q.view(b, s, self.heads, self.head_size).transpose(1, 2)
        k = k.view(b, s, self.kv_heads, self.head_size).transpose(1, 2)
        v = v.view(b, s, self.kv_heads, self.head_size).transpose(1, 2)
        attention = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self.kv_heads != self.heads)
        x = x + self.out(attention.transpose(1, 2).reshape(b, s, self.q_width))
        up = self.up(self.norm2(x))
        if self.gated:
            gate, up = up.chunk(2, dim=-1)
            up = F.silu(gate) * up
        else:
            up = F.gelu(up)
        return x + self.down(up)


def compute_probe(spec: dict, tp: int, micro_batches: list[int], repeats: int, device: str) -> dict[str, list]:
    """Achieved FLOP/s of one layer and of the LM head (forward + backward) per micro-batch size."""
    model = ModelSpec(**spec)
    dtype = DTYPES[model.dtype_bytes]
    torch.manual_seed(0)
    block = _LocalBlock(model, tp).to(device=device, dtype=dtype)
    head = torch.nn.Linear(model.hidden, model.vocab_size // tp, bias=False).to(device=device, dtype=dtype)
    layer_rates, head_rates = [], []
    for b in micro_batches:
        x = torch.randn(b, model.seq_len, model.hidden, device=device, dtype=dtype, requires_grad=True)
        labels = torch.randint(0, model.vocab_size // tp, (b * model.seq_len,), device=device)
        tokens = b * model.seq_len
        layer_s = _timed(lambda: block(x).float().sum().backward(), repeats, device)
        head_s = _timed(lambda: F.cross_entropy(head(x).float().view(tokens, -1), labels).backward(), repeats, device)
        layer_rates.append(3 * tokens * model.layer_flops_per_token / tp / layer_s)
        head_rates.append(3 * tokens * model.logits_flops_per_token / tp / head_s)
    return {"tokens": [b * model.seq_len for b in micro_batches], "layer": layer_rates, "head": head_rates}


# ---- collectives ---------------------------------------------------------------------------------


def _collective(kind: str, group, size_bytes: int, device: str) -> Callable[[], None]:
    n = dist.get_world_size(group)
    numel = max(n, size_bytes // 4 // n * n)
    full = torch.ones(numel, device=device)
    shard = torch.ones(numel // n, device=device)
    if kind == "all_reduce":
        return lambda: dist.all_reduce(full, group=group)
    if kind == "all_gather":
        return lambda: dist.all_gather_into_tensor(full, shard, group=group)
    if kind == "reduce_scatter":
        return lambda: dist.reduce_scatter_tensor(shard, full, group=group)
    if kind == "all_to_all":
        received = torch.empty_like(full)
        return lambda: dist.all_to_all_single(received, full, group=group)
    raise ValueError(f"collective kind={kind!r} is invalid")


def _ping_pong(group_ranks: list[int], size_bytes: int, device: str) -> Callable[[], None]:
    """Half of a round trip between the group's first two ranks (the send/recv cost)."""
    rank, (a, b) = dist.get_rank(), group_ranks[:2]
    buffer = torch.ones(max(1, size_bytes // 4), device=device)

    def run() -> None:
        if rank == a:
            dist.send(buffer, b)
            dist.recv(buffer, b)
        elif rank == b:
            dist.recv(buffer, a)
            dist.send(buffer, a)
    return run


def collective_probe(groups: list[list[int]], kinds: list[str], sizes: list[int], repeats: int,
                     device: str) -> list[dict]:
    """Time every kind at every size in every group, one group at a time (the others idle).
    Every rank takes part in creating every group; each group's first rank reports."""
    handles = [dist.new_group(ranks) for ranks in groups]
    rank, samples = dist.get_rank(), []
    for index, (ranks, handle) in enumerate(zip(groups, handles)):
        for kind in kinds:
            for size in sizes:
                member = rank in ranks
                if kind == "send_recv":
                    run = _ping_pong(ranks, size, device) if member else (lambda: None)
                else:
                    run = _collective(kind, handle, size, device) if member else (lambda: None)
                seconds = _timed(run, repeats, device)
                if kind == "send_recv":
                    seconds /= 2
                if rank == ranks[0]:
                    samples.append({"group": index, "kind": kind, "size_bytes": size, "seconds": seconds})
    return samples


# ---- overlap and the optimizer ---------------------------------------------------------------------


def overlap_probe(size_bytes: int, repeats: int, device: str) -> float:
    """Share of an all-reduce over every rank hidden when matmuls of about its length run beside it
    (an async collective, as DDP's and FSDP's reductions are): (C + X - both) / min(C, X)."""
    tensor = torch.ones(size_bytes // 4, device=device)
    a = torch.randn(256, 256, device=device)
    collective_s = _timed(lambda: dist.all_reduce(tensor), repeats, device)
    one = _timed(lambda: a @ a, repeats, device)
    count = max(1, round(collective_s / max(one, 1e-9)))

    def compute() -> None:
        for _ in range(count):
            a @ a

    def both() -> None:
        work = dist.all_reduce(tensor, async_op=True)
        compute()
        work.wait()

    compute_s = _timed(compute, repeats, device)
    both_s = _timed(both, repeats, device)
    hidden = (compute_s + collective_s - both_s) / min(compute_s, collective_s)
    return max(0.0, min(1.0, hidden))


def optimizer_probe(num_params: int, repeats: int, device: str) -> dict[str, float]:
    """AdamW seconds per parameter (its foreach update over a layer-sized list of tensors), and the
    fixed cost of a step: a tiny model's forward, backward, update, plus a scalar all-reduce
    (the loss every step reports)."""
    chunk = max(1, num_params // 16)
    params = [torch.nn.Parameter(torch.zeros(chunk, device=device)) for _ in range(16)]
    for p in params:
        p.grad = torch.zeros_like(p)
    optimizer = torch.optim.AdamW(params, lr=1e-3)
    per_param = _timed(optimizer.step, repeats, device) / (16 * chunk)
    tiny = torch.nn.Linear(8, 8).to(device)
    tiny_optimizer = torch.optim.AdamW(tiny.parameters(), lr=1e-3)
    x, loss = torch.randn(4, 8, device=device), torch.zeros(1, device=device)

    def step() -> None:
        tiny(x).sum().backward()
        tiny_optimizer.step()
        tiny_optimizer.zero_grad()
        dist.all_reduce(loss)

    return {"optimizer_s_per_param": per_param, "step_overhead_s": _timed(step, repeats, device)}
