"""The parallel layout a worker executes: degrees, data-parallel flavour, pipeline shape.

Ranks are laid out row-major over (pp, dp, cp, tp): tensor-parallel peers are
consecutive ranks, so a rank -> device mapping that puts consecutive ranks in
one NVSwitch island keeps TP traffic inside it; context-parallel peers (each
holding a part of every sequence) come next, as in torchtitan's mesh. Expert parallelism carves each
data-parallel group into blocks of `ep` consecutive replicas (dp index =
expert-data-parallel index x ep + expert-parallel index): an expert group sits
on neighbouring devices, inside a node first, as the planner maps it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from baige_ray.api.validation import require_choice, require_int, require_number

DATA_PARALLEL_KINDS = ("ddp", "fsdp2", "zero1", "zero2", "zero3")
# How context-parallel ranks attend to the keys the others hold (parallel/context_parallel.py): "ring"
# all-gathers keys and values over the CP group (torch's default rotation for its ring attention),
# "ulysses" exchanges heads for sequence by all-to-all (DeepSpeed-Ulysses).
CONTEXT_PARALLEL_KINDS = ("ring", "ulysses")
PIPELINE_SCHEDULES = ("1f1b", "interleaved-1f1b")
# Activation recomputation the engines run: "full" keeps each transformer block's input alone for backward
# and runs the block's forward again there (torchtitan's full activation checkpointing).
RECOMPUTE_KINDS = ("none", "full")

if TYPE_CHECKING:
    from baige_ray.api.configs import TrainConfig


@dataclass(frozen=True)
class RankCoords:
    pp: int
    dp: int
    tp: int
    cp: int = 0


@dataclass(kw_only=True, frozen=True)
class ParallelLayout:
    dp: int = 1
    tp: int = 1
    pp: int = 1
    ep: int = 1  # experts sharded over groups of `ep` data-parallel replicas; divides dp
    data_parallel: str = "ddp"
    num_microbatches: int | None = None
    pipeline_schedule: str = "1f1b"
    # 1F1B only: forwards each non-last stage keeps in flight beyond 1F1B's p - r, so that a
    # stage slower than its successor never idles waiting for the first gradient (mixed chips).
    pipeline_run_ahead: int = 0
    stage_layers: tuple[int, ...] | None = None
    stage_speeds: tuple[float, ...] | None = None
    # Data parallel over chips of different speeds: micro-batches each DP replica trains per
    # step, in proportion to its chip's speed (e.g. (43, 21) of 64 at speeds 1.0 / 0.5), or a
    # global batch that does not split evenly over dp (e.g. (17, 17, 17, 17, 16) of 84); None
    # splits the global batch evenly. Without TrainConfig.micro_batch_size the shares count
    # sequences and each replica trains its share in one pass. Losses are weighted so a step's
    # gradient is the mean over the whole global batch, whatever the split.
    dp_microbatches: tuple[int, ...] | None = None
    # With tp > 1: each TP rank holds 1/tp of the sequence between the tensor-parallel regions (norms,
    # residual stream), Megatron-LM's sequence parallelism, where the model's plug-in offers it (dense
    # models; an MoE model's whole MLPs keep the sequence whole). False: plain column/row splits.
    sequence_parallel: bool = True
    # Context parallelism: each of `cp` ranks holds 1/cp of every sequence (two chunks of 1/(2 cp), one
    # from each end, so causal attention costs every rank the same) and attends to the others' keys as
    # `cp_kind` says. Weights are replicated over cp and their gradients summed over dp x cp.
    cp: int = 1
    cp_kind: str = "ring"
    # "full": every transformer block's activations recomputed in backward (RECOMPUTE_KINDS), about one more
    # forward of compute for keeping one tensor per block instead of all of them.
    recompute: str = "none"

    def __post_init__(self) -> None:
        for name in ("dp", "tp", "pp", "ep", "cp"):
            require_int("ParallelLayout", name, getattr(self, name), minimum=1)
        require_choice("ParallelLayout", "data_parallel", self.data_parallel, DATA_PARALLEL_KINDS)
        require_choice("ParallelLayout", "pipeline_schedule", self.pipeline_schedule, PIPELINE_SCHEDULES)
        require_choice("ParallelLayout", "recompute", self.recompute, RECOMPUTE_KINDS)
        if self.num_microbatches is not None:
            require_int("ParallelLayout", "num_microbatches", self.num_microbatches, minimum=1)
        require_int("ParallelLayout", "pipeline_run_ahead", self.pipeline_run_ahead, minimum=0)
        if not isinstance(self.sequence_parallel, bool):
            raise ValueError(f"ParallelLayout.sequence_parallel={self.sequence_parallel!r} is invalid: expected True or False")
        if self.data_parallel.startswith("zero") and (self.tp > 1 or self.pp > 1):
            raise ValueError(
                f"ParallelLayout.data_parallel={self.data_parallel!r} is invalid with tp={self.tp}, pp={self.pp}: "
                "expected 'ddp' or 'fsdp2' when tensor or pipeline parallelism is used"
            )
        self._check_expert_parallel()
        self._check_context_parallel()
        self._check_stage_tuple("stage_layers", self.stage_layers, int)
        self._check_stage_tuple("stage_speeds", self.stage_speeds, float)
        self._check_dp_microbatches()

    def _check_expert_parallel(self) -> None:
        if self.ep == 1:
            return
        if self.dp % self.ep:
            raise ValueError(f"ParallelLayout.ep={self.ep} is invalid: expected a divisor of dp={self.dp}")
        if self.data_parallel == "zero3":
            raise ValueError(
                f"ParallelLayout.ep={self.ep} is invalid with data_parallel='zero3': expected 'ddp', 'fsdp2', "
                "'zero1' or 'zero2' (DeepSpeed keeps expert-parallel parameters in its MoE groups under ZeRO "
                "stage 1 or 2 only; 'fsdp2' shards the dense weights beside EP)"
            )

    def _check_context_parallel(self) -> None:
        require_choice("ParallelLayout", "cp_kind", self.cp_kind, CONTEXT_PARALLEL_KINDS)
        if self.cp == 1:
            return
        if self.pp > 1:
            raise ValueError(
                f"ParallelLayout.cp={self.cp} is invalid with pp={self.pp}: context parallelism runs with DDP, "
                "FSDP2 or DeepSpeed's ZeRO, tensor and expert parallelism; with pipeline parallelism it is not "
                "built yet"
            )
        if self.ep > 1 and self.data_parallel.startswith("zero"):
            raise ValueError(
                f"ParallelLayout.cp={self.cp} with ep={self.ep} is invalid with data_parallel="
                f"{self.data_parallel!r}: expected 'ddp' or 'fsdp2' (DeepSpeed's expert groups span data-parallel "
                "ranks only, not context-parallel ones)"
            )

    def _check_dp_microbatches(self) -> None:
        if self.dp_microbatches is None:
            return
        object.__setattr__(self, "dp_microbatches", tuple(self.dp_microbatches))
        if len(self.dp_microbatches) != self.dp:
            raise ValueError(
                f"ParallelLayout.dp_microbatches={self.dp_microbatches!r} is invalid: expected dp={self.dp} entries"
            )
        for count in self.dp_microbatches:
            require_int("ParallelLayout", "dp_microbatches", count, minimum=1)
        if self.tp > 1 or self.pp > 1 or self.ep > 1 or self.cp > 1 or self.data_parallel != "ddp":
            raise ValueError(
                f"ParallelLayout.dp_microbatches={self.dp_microbatches!r} is invalid with tp={self.tp}, "
                f"pp={self.pp}, ep={self.ep}, cp={self.cp}, data_parallel={self.data_parallel!r}: expected pure data parallel "
                "by 'ddp'"
            )

    def _check_stage_tuple(self, name: str, values: tuple | None, kind: type) -> None:
        if values is None:
            return
        object.__setattr__(self, name, tuple(values))
        if len(values) != self.pp * self.stages_per_rank:
            raise ValueError(f"ParallelLayout.{name}={values!r} is invalid: expected {self.num_stages} entries")
        for value in values:
            if kind is int:
                require_int("ParallelLayout", name, value, minimum=1)
            else:
                require_number("ParallelLayout", name, value, minimum=0, exclusive_minimum=True)

    @property
    def world_size(self) -> int:
        return self.dp * self.cp * self.tp * self.pp

    @property
    def gradient_replicas(self) -> int:
        """Ranks holding the same weights whose gradients are reduced together: dp x cp (a context-parallel
        rank computes the part of the gradient its part of each sequence contributes)."""
        return self.dp * self.cp

    @property
    def snapshots_are_sharded(self) -> bool:
        """FSDP2 and ZeRO-3 keep 1/dp of every tensor on a rank, which snapshots only its own pieces
        (parallel/shards.py): restoring a stage then needs the part of each of its ranks."""
        return self.gradient_replicas > 1 and self.ep == 1 and self.data_parallel in ("fsdp2", "zero3")

    @property
    def stages_per_rank(self) -> int:
        return 2 if self.pipeline_schedule == "interleaved-1f1b" and self.pp > 1 else 1

    @property
    def num_stages(self) -> int:
        return self.pp * self.stages_per_rank

    def microbatches(self, per_replica_batch: int) -> int:
        """Pipeline micro-batches per step: the layout's choice, else enough to fill the pipeline."""
        count = self.num_microbatches or min(per_replica_batch, 2 * self.num_stages)
        if per_replica_batch % count:
            raise ValueError(
                f"ParallelLayout.num_microbatches={count} is invalid: expected a divisor of the "
                f"per-replica batch {per_replica_batch}"
            )
        return count

    def replica_batches(self, train: TrainConfig) -> tuple[int, ...]:
        """Sequences each data-parallel replica trains per step; they add up to the global batch."""
        if self.dp_microbatches is None:
            return (train.per_worker_batch(self.dp),) * self.dp
        micro = train.micro_batch_size or 1
        if sum(self.dp_microbatches) * micro != train.global_batch_size:
            raise ValueError(
                f"ParallelLayout.dp_microbatches={self.dp_microbatches!r} is invalid: expected micro-batches of "
                f"TrainConfig.micro_batch_size={train.micro_batch_size} (None: of one sequence) adding up to the "
                f"global batch {train.global_batch_size}"
            )
        return tuple(count * micro for count in self.dp_microbatches)

    def coords(self, rank: int) -> RankCoords:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank={rank} is outside a world of {self.world_size}")
        pp, rest = divmod(rank, self.dp * self.cp * self.tp)
        dp, rest = divmod(rest, self.cp * self.tp)
        cp, tp = divmod(rest, self.tp)
        return RankCoords(pp=pp, dp=dp, tp=tp, cp=cp)

    def layers_per_stage(self, num_layers: int) -> tuple[int, ...]:
        """Explicit stage sizes, else layers split as evenly as possible (earlier stages get the extra)."""
        if self.stage_layers is not None:
            if sum(self.stage_layers) != num_layers:
                raise ValueError(
                    f"ParallelLayout.stage_layers={self.stage_layers!r} is invalid: expected a sum of {num_layers}"
                )
            return self.stage_layers
        if num_layers < self.num_stages:
            raise ValueError(f"{num_layers} layers cannot fill {self.num_stages} pipeline stages")
        base, extra = divmod(num_layers, self.num_stages)
        return tuple(base + (1 if stage < extra else 0) for stage in range(self.num_stages))

    def stage_indices(self, pp_rank: int) -> tuple[int, ...]:
        """Pipeline stages held by a pp rank; interleaving gives rank r stages r and r + pp."""
        return tuple(pp_rank + round_ * self.pp for round_ in range(self.stages_per_rank))

    def describe(self) -> str:
        parts = [f"{name.upper()}{getattr(self, name)}" for name in ("dp", "ep", "cp", "tp", "pp")
                 if getattr(self, name) > 1]
        no_sp = ", no SP" if self.tp > 1 and not self.sequence_parallel else ""
        cp_kind = f", {self.cp_kind} CP" if self.cp > 1 else ""
        recompute = f", {self.recompute} recompute" if self.recompute != "none" else ""
        return "x".join(parts or ["single"]) + f" ({self.data_parallel}{no_sp}{cp_kind}{recompute})"


def balanced_stage_layers(layer_costs: tuple[float, ...], num_stages: int) -> tuple[int, ...]:
    """Contiguous blocks of layers, one per stage, at least one each, minimizing the costliest stage
    (e.g. dense layers cheaper than MoE ones: a stage of dense layers takes more of them)."""
    n = len(layer_costs)
    if n < num_stages:
        raise ValueError(f"{n} layers cannot fill {num_stages} pipeline stages")
    prefix = [0.0]
    for cost in layer_costs:
        prefix.append(prefix[-1] + cost)
    # best[s][i]: the smallest possible costliest stage when the first i layers fill s stages
    best = [[float("inf")] * (n + 1) for _ in range(num_stages + 1)]
    cut = [[0] * (n + 1) for _ in range(num_stages + 1)]
    best[0][0] = 0.0
    for stages in range(1, num_stages + 1):
        for end in range(stages, n - (num_stages - stages) + 1):
            for start in range(stages - 1, end):
                worst = max(best[stages - 1][start], prefix[end] - prefix[start])
                if worst < best[stages][end]:
                    best[stages][end], cut[stages][end] = worst, start
    sizes, end = [], n
    for stages in range(num_stages, 0, -1):
        start = cut[stages][end]
        sizes.append(end - start)
        end = start
    return tuple(reversed(sizes))


_LAYOUT_KEYS = {"dp": int, "tp": int, "pp": int, "ep": int, "cp": int, "cpkind": str, "engine": str, "micro": int,
                "schedule": str, "ahead": int, "sp": int, "recompute": str}


def parse_layout(text: str) -> ParallelLayout | str:
    """'ddp', 'auto', or degrees such as 'dp=2,tp=2,pp=2,engine=fsdp2,micro=4,schedule=interleaved-1f1b,ahead=1'
    (and ep=2 for expert parallelism, sp=0 for tensor parallelism without sequence parallelism, cp=2 for
    context parallelism with cpkind=ring or cpkind=ulysses, recompute=full for activation recomputation)."""
    if text in ("ddp", "auto"):
        return text
    fields = {}
    for item in filter(None, text.split(",")):
        key, _, value = item.partition("=")
        if key not in _LAYOUT_KEYS or not value:
            raise ValueError(f"layout item {item!r} is invalid: expected key=value with key in {sorted(_LAYOUT_KEYS)}")
        try:
            fields[key] = _LAYOUT_KEYS[key](value)
        except ValueError:
            raise ValueError(f"layout item {item!r} is invalid: {key} takes an integer") from None
    renamed = {"engine": "data_parallel", "micro": "num_microbatches", "schedule": "pipeline_schedule",
               "ahead": "pipeline_run_ahead", "sp": "sequence_parallel", "cpkind": "cp_kind"}
    if "sp" in fields:
        if fields["sp"] not in (0, 1):
            raise ValueError(f"layout item 'sp={fields['sp']}' is invalid: expected sp=0 or sp=1")
        fields["sp"] = bool(fields["sp"])
    return ParallelLayout(**{renamed.get(key, key): value for key, value in fields.items()})
