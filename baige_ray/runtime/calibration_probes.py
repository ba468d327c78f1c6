"""Probes a worker actor runs for `baige-ray calibrate`: compute, collectives, overlap, optimizer.

Every probe runs in all workers of one process group at once (gloo on CPU, NCCL on GPU, the
same code), so that devices sharing a host's cores or a node's links are measured as they
run during training. Results are plain numbers; fitting them is the planner's job
(planner/calibration.py).
"""

from __future__ import annotations

import gc
import importlib
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from baige_ray.planner.model_spec import ModelSpec

DTYPES = {2: torch.bfloat16, 4: torch.float32}
# Layers the compute probe times as one stack on an accelerator, whose kernels are launched while the
# ones before them run, as in a model: one layer timed alone pays every launch. Qwen2.5-0.5B's layer
# alone on one H200 ran at 23-77 TFLOP/s for 1,024-4,096 tokens, and the step it priced took 24-56% less.
ASYNC_PROBE_LAYERS = 4
# Rounds the compute and sharded-layer probes split each shape's window into, every shape timed in every
# round (a call longer than the round's share: one call a round); the median round is the figure
# (`_in_rounds`). On 8 ranks sharing 2 cores a moment's speed swings: five probes in a row timed GPT's
# TP-2 layer of 128 tokens (the mean over ranks) at 70-126 ms with that call timed once, at 68-75 ms in
# rounds; a calibration whose TP-2 and TP-4 layers were timed once each priced those layouts 10-57% long.
COMPUTE_ROUNDS = 3


def _timed(run: Callable[[], None], repeats: int, device: str, warm_up: bool = True) -> float:
    """Median seconds of `run` (after one warm-up call), every repeat started together on all ranks."""
    if warm_up:
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


def _seconds_per_call(run: Callable[[], None], window_s: float, device: str, collective: bool = False,
                      prepare: Callable[[], None] | None = None, warm_up: bool = True) -> float:
    """Mean seconds of `run` called back to back for `window_s` (at least once, after a warm-up call unless
    `warm_up` is False: it ran warm just before) while every rank does the same: each rank keeps busy the
    whole window, so ranks sharing cores get fair shares of them.
    A `run` holding a collective is called as often on every rank: the count the slowest rank's first
    call implies. `prepare`, untimed, runs before each call (what the step does before `run`: the
    caches it leaves behind are the ones `run` meets in a step)."""
    count = None
    if collective:
        one, with_prepare = _one_call(run, prepare, device, warm_up)
        agreed = torch.tensor([max(1.0, window_s / max(with_prepare, 1e-9))])
        dist.all_reduce(agreed, op=dist.ReduceOp.MIN)
        count = int(agreed.item())
        if count == 1:  # a call as long as the window: the one just timed, every rank started together, is it
            return one
    elif warm_up:
        if prepare is not None:
            prepare()
        run()
    dist.barrier()
    _sync(device)
    window_started, spent, calls = time.perf_counter(), 0.0, 0
    while (calls < count) if count is not None else (calls < 1 or time.perf_counter() - window_started < window_s):
        if prepare is not None:
            prepare()
            _sync(device)
        start = time.perf_counter()
        run()
        _sync(device)
        spent += time.perf_counter() - start
        calls += 1
    return spent / calls


def _one_call(run: Callable[[], None], prepare: Callable[[], None] | None, device: str,
              warm_up: bool = True) -> tuple[float, float]:
    """Seconds of one call of `run` (after a warm-up call unless `warm_up` is False), every rank started
    together, without and with the untimed `prepare` before it (an optimizer step's backward can take
    longer than the step: counted in, a TP 2 layer's update priced 124 ms against 19-25 ms at TP 1 and 4)."""
    for _ in range(2 if warm_up else 1):
        began = time.perf_counter()
        if prepare is not None:
            prepare()
        dist.barrier()
        _sync(device)
        start = time.perf_counter()
        run()
        _sync(device)
        end = time.perf_counter()
    return end - start, end - began


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


# ---- libraries -----------------------------------------------------------------------------------


def library_probe(sources: list[Any], tensor_parallel: bool, deepspeed: bool, device: str) -> float:
    """Seconds this rank takes to import what the probes after it use: torch._dynamo (every optimizer
    imports it), DTensor's tensor parallelism, DeepSpeed, and each of `sources`' model library (its
    plug-in builds a layer on the meta device). Every probe would import these on its first call,
    untimed; loading them first keeps each probe's seconds its measuring: eight processes sharing 2
    cores took 10-18 s to import transformers, torch._dynamo and DeepSpeed, as long as the measuring."""
    started = time.perf_counter()
    torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1, device=device))])  # imports torch._dynamo
    for needed, module in ((tensor_parallel, "torch.distributed.tensor.parallel"), (deepspeed, "deepspeed")):
        if needed:
            importlib.import_module(module)
    if sources:
        from baige_ray.models.plugin import plugin_for

        for source in sources:
            plugin_for(source).build_probe_layers(1, torch.device("meta"))
    # What the imports made lives as long as the process: the full collections DeepSpeed asks for while it
    # builds an engine then scan only what the probes made (one scanned 403,000 objects in 0.9 s, 8 ranks
    # on 2 cores).
    gc.freeze()
    return time.perf_counter() - started


# ---- compute -------------------------------------------------------------------------------------


class _LocalBlock(torch.nn.Module):
    """One decoder layer whose attention and MLP run on a TP rank's share (1 / tp of the heads and of
    the FFN). `local_weights`: the matrices are that share (a rank's GEMM shapes, no communication);
    otherwise they are whole, for DTensor to shard over a TP mesh as the engines do."""

    def __init__(self, model: ModelSpec, tp: int, local_weights: bool = True):
        super().__init__()
        size = tp if local_weights else 1
        h, q, kv = model.hidden, model.q_dim, model.kv_dim
        ffn = model.top_k * model.expert_ffn + model.shared_expert_ffn if model.is_moe else model.ffn_hidden
        self.heads, self.kv_heads, self.head_size = model.num_heads // tp, model.kv_heads // tp, model.head_size
        norm = torch.nn.RMSNorm if model.rms_norm else torch.nn.LayerNorm
        self.norm1, self.norm2 = norm(h), norm(h)
        self.qkv = torch.nn.Linear(h, (q + 2 * kv) // size, bias=False)
        self.out = torch.nn.Linear(q // size, h, bias=False)
        self.gated = model.gated_mlp
        self.up = torch.nn.Linear(h, (2 if self.gated else 1) * ffn // size, bias=False)
        self.down = torch.nn.Linear(ffn // size, h, bias=False)
        self.q_width, self.kv_width = q // tp, kv // tp

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


def _probe_layers(model: ModelSpec, count: int, source: Any, device: str, dtype,
                  tp_mesh=None) -> tuple[torch.nn.Module, list[torch.nn.Module]]:
    """`count` decoder layers as one module from hidden states to hidden states, and its blocks.

    With `source` (the model's config) they are the model's own, built by its plug-in and, over
    `tp_mesh`, parallelized by its own tensor-parallel plan, as the engines run them: a model's layer
    can cost more than a generic one of its shapes (GPT's, with separate q, k, v projections and
    biases: 5% more at TP 1, 21% more at TP 4, where every projection is a DTensor op). Without one
    (a shape alone, or experts, which the engines route apart) a generic layer of the model's shapes."""
    if source is not None and not model.is_moe:
        from baige_ray.engines.parallelize import apply_tensor_parallel
        from baige_ray.models.plugin import plugin_for

        plugin = plugin_for(source)
        stage = plugin.build_probe_layers(count, torch.device(device)).to(dtype)
        blocks = plugin.stage_blocks(stage)
        if tp_mesh is not None:
            apply_tensor_parallel(blocks, tp_mesh, plugin.tensor_parallel_plan(tp_mesh.size()))
        return stage, blocks
    tp = tp_mesh.size() if tp_mesh is not None else 1
    blocks = [_LocalBlock(model, tp, local_weights=False).to(device=device, dtype=dtype) for _ in range(count)]
    if tp_mesh is not None:
        _parallelize_blocks(blocks, tp_mesh)
    return torch.nn.Sequential(*blocks), blocks


def _probe_head(model: ModelSpec, device: str, dtype, tp_mesh=None) -> torch.nn.Module:
    """The LM head; over `tp_mesh` vocabulary-parallel, its logits gathered for the loss."""
    head = torch.nn.Linear(model.hidden, model.vocab_size, bias=False).to(device=device, dtype=dtype)
    if tp_mesh is not None:
        from torch.distributed.tensor import Replicate
        from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

        parallelize_module(head, tp_mesh, ColwiseParallel(output_layouts=Replicate()))
    return head


def _tp_mesh(device: str, tp: int, rest: str = "rest"):
    """A mesh of TP groups of `tp` consecutive ranks (the "tp" dimension) by the rest of the world."""
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(device.split(":")[0], (dist.get_world_size() // tp, tp), mesh_dim_names=(rest, "tp"))


def compute_probe(spec: dict, tp: int, micro_batches: list[int], window_s: float, device: str,
                  source: Any = None) -> dict[str, list]:
    """Achieved FLOP/s of a layer (the model's own with `source`, its config: `_probe_layers`; on an
    accelerator a stack of ASYNC_PROBE_LAYERS, per layer) and of the LM head (forward + backward) per
    micro-batch size, each kept running for `window_s` on every rank at once, in COMPUTE_ROUNDS parts
    (`_in_rounds`). With `tp` > 1 they run tensor-parallel over TP groups of consecutive ranks, so the
    figures hold DTensor's cost and the TP collectives, loaded. Then the update's seconds of a layer and
    of the head (`_update_seconds`)."""
    model = ModelSpec(**spec)
    dtype = DTYPES[model.dtype_bytes]
    torch.manual_seed(0)
    tp_mesh = _tp_mesh(device, tp)["tp"] if tp > 1 else None
    layers = 1 if device == "cpu" else ASYNC_PROBE_LAYERS
    block, _ = _probe_layers(model, layers, source, device, dtype, tp_mesh)
    head = _probe_head(model, device, dtype, tp_mesh)
    calls = [_layer_and_head_calls(model, block, head, b, device, dtype) for b in micro_batches]
    communicates = tp > 1
    # The first calls a process makes run up to 2x slow (a TP-2 GPT layer: 0.20 s per call against 0.10 s
    # timed again, whichever micro-batch came first): the largest micro-batch runs once, untimed, first.
    for warm_up in calls[-1]:
        warm_up()
    layer_rates, head_rates, layer_seconds = [], [], []
    timed = _in_rounds([call for pair in calls for call in pair], COMPUTE_ROUNDS, window_s, device, communicates)
    for index, b in enumerate(micro_batches):
        tokens = b * model.seq_len
        layer_s, head_s = timed[2 * index], timed[2 * index + 1]
        layer_seconds.append(layer_s / layers)
        layer_rates.append(3 * tokens * model.layer_flops_per_token * layers / tp / layer_s)
        head_rates.append(3 * tokens * model.logits_flops_per_token / tp / head_s)
    layer_update, head_update = _update_seconds(block, head, calls[0], window_s, device, tp > 1)
    return {"tokens": [b * model.seq_len for b in micro_batches], "layer": layer_rates, "head": head_rates,
            "layer_s": layer_seconds, "optimizer_s": [layer_update / layers, head_update]}


def _update_seconds(block: torch.nn.Module, head: torch.nn.Module, backwards: tuple[Callable[[], None], ...],
                    window_s: float, device: str, tensor_parallel: bool) -> tuple[float, float]:
    """Seconds of clipping and updating `block`'s parameters and the head's, each after its backward
    (`backwards`, the smallest micro-batch's: any backward evicts the weights from cache, and the largest
    one's would cost most of the probe's time). Tensor-parallel, each update's gradient norm all-reduces
    over the TP group, which a step does once for all its parameters: the head is timed alone, the block
    with the head, so the block's figure is what it adds to an update and the collective is the head's
    alone: priced on the last pipeline stage, the one that holds the head (a TP-2 GPT layer's update timed
    alone priced 37 ms a layer, the engine's whole update of 4 layers and the head took 83 ms)."""
    layer_backward, head_backward = backwards
    head_only = _optimizer_seconds(head, window_s, device, tensor_parallel, head_backward)
    if not tensor_parallel:
        return _optimizer_seconds(block, window_s, device, False, layer_backward), head_only
    both = _optimizer_seconds(torch.nn.ModuleList([block, head]), window_s, device, True,
                              lambda: (layer_backward(), head_backward()))
    return max(0.0, both - head_only), head_only  # shorter together than the head alone: noise, adds nothing


def _in_rounds(runs: list[Callable[[], None]], rounds: int, window_s: float, device: str,
               collective: bool) -> list[float]:
    """Seconds per call of each of `runs`: the median of `rounds` windows of `window_s / rounds`, each round
    timing every run once, so that a moment the host runs slow weighs on one window of each, not on every
    window of one. Only the first round warms up. A call longer than a round's share is timed once a
    round: `rounds` calls, the median of which leaves out one slow moment as the windows' median does."""
    rounds = max(1, rounds)
    share = window_s / rounds
    samples = [[_seconds_per_call(run, share, device, collective)] for run in runs]
    for _ in range(rounds - 1):
        for index, run in enumerate(runs):
            samples[index].append(_seconds_per_call(run, share, device, collective, warm_up=False))
    return [statistics.median(taken) for taken in samples]


def _layer_and_head_calls(model: ModelSpec, block: torch.nn.Module, head: torch.nn.Module, micro_batch: int,
                          device: str, dtype) -> tuple[Callable[[], None], Callable[[], None]]:
    """Forward + backward of `block` and of `head` (with the loss) on a micro-batch of random hidden states."""
    x = torch.randn(micro_batch, model.seq_len, model.hidden, device=device, dtype=dtype, requires_grad=True)
    tokens = micro_batch * model.seq_len
    labels = torch.randint(0, model.vocab_size, (tokens,), device=device)

    def layer_backward() -> None:
        block(x).float().sum().backward()

    def head_backward() -> None:
        F.cross_entropy(head(x).float().view(tokens, -1), labels).backward()

    return layer_backward, head_backward


def sharded_layer_probe(spec: dict, tp: int, micro_batches: list[int], window_s: float, device: str,
                        engine: str = "fsdp2", layers: int = 2, source: Any = None,
                        zero_stages: tuple[int, ...] = (3,)) -> dict[str, Any]:
    """Seconds per layer and micro-batch of a ZeRO layer's forward + backward (+ the step), as the engine
    that runs it does it, per ZeRO stage of `zero_stages`: FSDP2 (`engine="fsdp2"`, ZeRO-3 beside TP) or
    DeepSpeed (`"deepspeed"`, stages 1-3 without TP). ZeRO-3 gathers each layer before its forward and
    again before its backward, the next one prefetched, and reduce-scatters its gradients; DeepSpeed's
    ZeRO-1/2 reduce the gradients into partitions during backward, step the rank's partition and
    all-gather the updated weights, one step per call. `layers` blocks (the model's own with `source`, as
    in `compute_probe`; tensor-parallel over TP groups of consecutive ranks when `tp` > 1, data-parallel
    over the rest) are timed with every rank busy; the compute probe's plain layer, taken off, leaves
    what the engine adds. DeepSpeed's timings hold its optimizer step on the rank's shard, so the plain
    update of a shard's share is taken off them (the planner prices the update apart).
    Returns {"tokens": [...], "layer_s": {stage: [seconds per layer, per token count]}}."""
    if engine not in ("fsdp2", "deepspeed"):
        raise ValueError(f"engine={engine!r} is invalid: expected 'fsdp2' or 'deepspeed'")
    if engine == "fsdp2" and tuple(zero_stages) != (3,):
        raise ValueError(f"zero_stages={zero_stages!r} is invalid for FSDP2: expected (3,)")
    if not zero_stages or not set(zero_stages) <= {1, 2, 3}:
        raise ValueError(f"zero_stages={zero_stages!r} is invalid: expected stages among 1, 2, 3")
    model = ModelSpec(**spec)
    dtype = DTYPES[model.dtype_bytes]
    mesh = _tp_mesh(device, tp, rest="dp")
    inputs = [torch.randn(b, model.seq_len, model.hidden, device=device, dtype=dtype, requires_grad=True)
              for b in micro_batches]

    def stack_of_layers():
        torch.manual_seed(0)
        return _probe_layers(model, layers, source, device, dtype, mesh["tp"] if tp > 1 else None)

    def per_call(forward, backward=lambda loss: loss.backward()) -> list[float]:
        # In rounds, as the compute probe times the plain layer these are compared with.
        return _in_rounds([lambda x=x: backward(forward(x).float().sum()) for x in inputs], COMPUTE_ROUNDS,
                          window_s, device, collective=True)

    per_stage = {}
    if engine == "fsdp2":
        stack, blocks = stack_of_layers()
        per_stage[3] = [s / len(blocks) for s in per_call(_fully_sharded(stack, blocks, mesh["dp"]))]
    else:
        stack, blocks = stack_of_layers()
        stack(inputs[0]).float().sum().backward()  # gradients for the plain update's timing
        update_share = _optimizer_seconds(stack, window_s, device, False) / mesh["dp"].size()
        for stage in sorted(zero_stages):  # ZeRO-3 last: it partitions the weights of the stack in place
            stack, blocks = stack_of_layers()
            wrapped = _deepspeed_zero(stack, dist.get_world_size(), stage)
            sharded = per_call(wrapped, lambda loss, engine=wrapped: (engine.backward(loss), engine.step()))
            per_stage[stage] = [(s - update_share) / len(blocks) for s in sharded]
    return {"tokens": [b * model.seq_len for b in micro_batches], "layer_s": per_stage}


def _parallelize_blocks(blocks: list[torch.nn.Module], tp_mesh) -> None:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    for block in blocks:
        parallelize_module(block, tp_mesh, {"qkv": ColwiseParallel(), "out": RowwiseParallel(),
                                            "up": ColwiseParallel(), "down": RowwiseParallel()})


def _fully_sharded(stack: torch.nn.Module, blocks: list[torch.nn.Module], dp_mesh) -> torch.nn.Module:
    from torch.distributed.fsdp import fully_shard

    for block in blocks:
        fully_shard(block, mesh=dp_mesh)
    return fully_shard(stack, mesh=dp_mesh)


def _deepspeed_zero(stack: torch.nn.Sequential, world_size: int, stage: int):
    """`stack` under DeepSpeed ZeRO-`stage` with AdamW, one update per call, as the engines configure it."""
    import os

    from baige_ray.engines.deepspeed_init import initialize

    os.environ.setdefault("LOCAL_RANK", "0")  # DeepSpeed reads these even when the process group exists
    os.environ["RANK"], os.environ["WORLD_SIZE"] = str(dist.get_rank()), str(world_size)
    config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
              "zero_optimization": {"stage": stage}, "zero_allow_untested_optimizer": True, "gradient_clipping": 1.0,
              "steps_per_print": 2**31}
    engine, *_ = initialize(model=stack, optimizer=torch.optim.AdamW(stack.parameters(), lr=1e-6),
                            config=config, dist_init_required=False)
    return engine


def _optimizer_seconds(module: torch.nn.Module, window_s: float, device: str, communicates: bool,
                       backward: Callable[[], None] | None = None) -> float:
    """Gradient clipping and an AdamW update of `module`'s parameters (DTensors when tensor-parallel):
    the per-step framework cost a layer or the head adds, as the engines' optimizer step runs it: their
    own clipping (a float64 norm and a scale of every gradient) and, with `backward`, each update right
    after a backward pass, whose activations have pushed the weights and optimizer state out of cache
    (the update of a layer after its backward ran 15-20% slower than back to back, 8 ranks on 2 cores)."""
    from baige_ray.engines.parallelize import clip_grad_norm

    params = [p for p in module.parameters() if p.grad is not None]
    optimizer = torch.optim.AdamW(params, lr=1e-3, foreach=False)
    # The gradients of a summed output have norms far above 1: the first call scales them to norm 1, every
    # later one by 1 / (1 + 1e-6), so each call scales as early training does, without shrinking them away.
    return _seconds_per_call(lambda: (clip_grad_norm(params, 1.0, None), optimizer.step()), window_s, device,
                             communicates, prepare=backward)


def host_sharing_probe(spec: dict, micro_batch: int, window_s: float, active: list[int], device: str) -> float | None:
    """Seconds per call of one layer's forward + backward on this rank while only the `active` ranks
    compute (the others sleep): run once with every rank active and once with one rank per host, the
    ratio says how much faster a device runs while its host's other devices idle (1 on GPUs)."""
    model = ModelSpec(**spec)
    torch.manual_seed(0)
    block = _LocalBlock(model, 1).to(device=device, dtype=DTYPES[model.dtype_bytes])
    x = torch.randn(micro_batch, model.seq_len, model.hidden, device=device, dtype=DTYPES[model.dtype_bytes])

    def run() -> None:
        block(x).float().sum().backward()

    run()
    dist.barrier()
    seconds = None
    if dist.get_rank() in active:
        start, calls = time.perf_counter(), 0
        while calls < 2 or time.perf_counter() - start < window_s:
            run()
            calls += 1
        seconds = (time.perf_counter() - start) / calls
    else:
        time.sleep(window_s)
    dist.barrier()
    return seconds


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


def _busy_work(seconds: float, device: str) -> Callable[[], None]:
    """Matmuls of about `seconds` on this rank while every rank runs them (the count is measured so)."""
    a = torch.randn(128, 128, device=device)
    one = _timed(lambda: a @ a, 5, device)
    count = max(1, round(seconds / max(one, 1e-9)))

    def work() -> None:
        for _ in range(count):
            a @ a
    return work


def loaded_collective_probe(partitions: list[list[list[int]]], kinds: list[str], sizes: list[int],
                            iterations: int, work_s: float, device: str) -> list[dict]:
    """Collectives as training meets them: every rank computes, then syncs with its group, all
    groups of a partition at once (as every TP or DP group of a layout does). A sample is the time a
    (compute, collective) iteration takes beyond the compute alone, over `iterations`: on hosts whose
    cores the ranks share it includes waiting for the peers to be scheduled. Each partition is a list
    of disjoint groups; ranks in none of them only compute. Every rank reports for its group."""
    rank = dist.get_rank()
    work = _busy_work(work_s, device)

    def loop(run: Callable[[], None]) -> Callable[[], None]:
        def iterate() -> None:
            for _ in range(iterations):
                work()
                run()
        return iterate

    alone = _timed(loop(lambda: None), 1, device)
    samples = []
    for index, groups in enumerate(partitions):
        handles = [dist.new_group(ranks) for ranks in groups]
        mine = next(((ranks, handle) for ranks, handle in zip(groups, handles) if rank in ranks), None)
        if mine is not None:  # a new group's first collective connects its ranks: not a sample's cost
            dist.all_reduce(torch.zeros(1, device=device), group=mine[1])
        for kind in kinds:
            for size in sizes:
                if mine is None:
                    run = lambda: None  # noqa: E731
                elif kind == "send_recv":
                    run = _ping_pong(mine[0], size, device) if rank in mine[0][:2] else (lambda: None)
                else:
                    run = _collective(kind, mine[1], size, device)
                seconds = (_timed(loop(run), 1, device, warm_up=False) - alone) / iterations
                if mine is not None:
                    samples.append({"partition": index, "kind": kind, "size_bytes": size,
                                    "seconds": max(seconds / (2 if kind == "send_recv" else 1), 1e-7)})
    return samples


# ---- overlap and the optimizer ---------------------------------------------------------------------


def overlap_probe(size_bytes: int, window_s: float, device: str) -> float:
    """Share of an all-reduce over every rank hidden when matmuls of about its length run beside it
    (an async collective, as DDP's and FSDP's reductions are): (C + X - both) / min(C, X), each of the
    three kept running for `window_s` on every rank at once."""
    tensor = torch.ones(size_bytes // 4, device=device)
    collective_s = _seconds_per_call(lambda: dist.all_reduce(tensor), window_s, device, collective=True)
    compute = _busy_work(collective_s, device)

    def both() -> None:
        work = dist.all_reduce(tensor, async_op=True)
        compute()
        work.wait()

    compute_s = _seconds_per_call(compute, window_s, device)
    both_s = _seconds_per_call(both, window_s, device, collective=True)
    hidden = (compute_s + collective_s - both_s) / min(compute_s, collective_s)
    return max(0.0, min(1.0, hidden))


def synchronization_probe(spec: dict, micro_batch: int, window_s: float, device: str) -> float:
    """Seconds a step's synchronization adds beside a layer's forward + backward on every rank: the
    same work with and without a scalar all-reduce after it. Ranks that share cores drift apart while
    they compute (the scheduler runs some before others), so a collective waits for the last of them:
    7-11 ms per synchronization on this 2-core host with 8 ranks, about the all-reduce's latency on GPUs."""
    model = ModelSpec(**spec)
    torch.manual_seed(0)
    block = _LocalBlock(model, 1).to(device=device, dtype=DTYPES[model.dtype_bytes])
    x = torch.randn(micro_batch, model.seq_len, model.hidden, device=device, dtype=DTYPES[model.dtype_bytes])
    scalar = torch.zeros(1, device=device)

    def compute() -> None:
        block(x).float().sum().backward()

    alone = _seconds_per_call(compute, window_s, device)
    synchronized = _seconds_per_call(lambda: (compute(), dist.all_reduce(scalar)), window_s, device, collective=True)
    return max(0.0, synchronized - alone)


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
