"""Measured figures of one cluster that replace the cost model's nominal constants.

`baige-ray calibrate` (jobs/calibrate.py) runs probes in the worker actors and fills a
`Calibration`; this module only holds the figures, fits them and answers the cost model's
questions, with plain arithmetic:

  * compute: achieved FLOP/s of one device on a decoder layer (forward + backward) and on
    the LM head of the model's own shapes, per TP degree (the local shard's shapes), at
    several micro-batch sizes, measured with every device of the cluster busy at once (on a
    host whose cores the devices share, that is the speed each of them gets). Between the
    measured token counts the rate is interpolated in log-log space; below them it is held, above
    them a call's time grows by the seconds per token between the last two.
  * links: latency and bandwidth per link tier, fitted by least squares (relative error)
    to all-reduce, all-gather, reduce-scatter, all-to-all and point-to-point timings at
    several message and group sizes through the same alpha-beta formulas the cost model
    prices with (cost.py), so the fitted figures mean what the descriptor's nominal ones mean.
  * overlap: the share of a collective's time hidden when it runs beside compute (DDP's
    and FSDP's background reductions). 1.0 on GPUs whose copy engines and SMs run NCCL
    beside the GEMMs; far less on CPU cores that do both.
  * framework: the optimizer update per parameter and the fixed cost of a step.

Anything not measured stays nominal; `measured_terms` / `nominal_terms` say which is which.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from baige_ray.planner.model_spec import ModelSpec
from baige_ray.topology.graph import ResourceGraph

COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send_recv")
TIER_NAMES = ("NVLINK", "PCIE", "SAME_RAIL", "CROSS_RAIL", "CROSS_POD")
FORMAT_VERSION = 1


def collective_coefficients(kind: str, group_size: int, size_bytes: float) -> tuple[float, float]:
    """(latency multiplier, bytes over the link) of one collective in cost.py's alpha-beta model:
    ring all-reduce 2(n-1) alpha + 2(n-1)/n M beta; all-gather, reduce-scatter and pairwise
    all-to-all (n-1) alpha + (n-1)/n M beta; send/recv alpha + M beta."""
    n = float(group_size)
    if kind == "all_reduce":
        return 2 * (n - 1), 2 * (n - 1) / n * size_bytes
    if kind in ("all_gather", "reduce_scatter", "all_to_all"):
        return n - 1, (n - 1) / n * size_bytes
    if kind == "send_recv":
        return 1.0, size_bytes
    raise ValueError(f"collective kind={kind!r} is invalid: expected one of {list(COLLECTIVES)}")


@dataclass(kw_only=True, frozen=True)
class CollectiveSample:
    tier: int
    kind: str
    group_size: int
    size_bytes: float
    seconds: float


@dataclass(kw_only=True, frozen=True)
class LinkFit:
    """Latency (s) and bandwidth (bytes/s) of one tier over all collectives, and per collective kind
    (`kinds`: kind -> LinkFit of that kind's samples alone); `rms_rel_error` of the fit."""

    tier: int
    latency_s: float
    bandwidth: float
    num_samples: int
    rms_rel_error: float
    kinds: dict[str, LinkFit] = field(default_factory=dict, compare=False)

    @property
    def tier_name(self) -> str:
        return TIER_NAMES[self.tier]


def fit_link(samples: list[CollectiveSample]) -> LinkFit:
    """One fit over every kind, and one per kind (gloo's and NCCL's algorithms differ per collective)."""
    overall = _fit(samples)
    kinds = {kind: _fit([s for s in samples if s.kind == kind]) for kind in sorted({s.kind for s in samples})}
    return dataclasses.replace(overall, kinds=kinds)


def _fit(samples: list[CollectiveSample]) -> LinkFit:
    """Least squares on relative error (each sample weighted by 1 / its time, so a 64 KiB message
    counts as much as a 16 MiB one), latency and 1 / bandwidth kept non-negative."""
    if not samples:
        raise ValueError("fit_link needs at least one sample")
    rows = np.array([collective_coefficients(s.kind, s.group_size, s.size_bytes) for s in samples])
    times = np.array([s.seconds for s in samples])
    weighted = rows / times[:, None]
    solution, *_ = np.linalg.lstsq(weighted, np.ones(len(samples)), rcond=None)
    if solution[0] < 0 or solution[1] <= 0:  # the boundary of the non-negative quadrant
        solution = _best_on_axes(weighted)
    predicted = rows @ solution
    error = float(np.sqrt(np.mean((predicted / times - 1.0) ** 2)))
    bandwidth = 1.0 / solution[1] if solution[1] > 0 else float("inf")
    return LinkFit(tier=samples[0].tier, latency_s=float(solution[0]), bandwidth=float(bandwidth),
                   num_samples=len(samples), rms_rel_error=error)


def _best_on_axes(weighted: np.ndarray) -> np.ndarray:
    """Best fit with one of the two unknowns at zero (bandwidth-only is tried first)."""
    target = np.ones(len(weighted))
    best, best_error = None, float("inf")
    for column in (1, 0):
        a = weighted[:, column]
        value = max(float(a @ target / (a @ a)), 0.0) if a @ a > 0 else 0.0
        solution = np.zeros(2)
        solution[column] = value
        error = float(np.sum((weighted @ solution - target) ** 2))
        if value > 0 and error < best_error:
            best, best_error = solution, error
    return best if best is not None else np.array([0.0, 1e-12])


@dataclass(kw_only=True, frozen=True)
class ComputeCurve:
    """Achieved FLOP/s at several token counts (micro-batch x sequence), ascending."""

    tokens: tuple[int, ...]
    flops_per_s: tuple[float, ...]

    def __post_init__(self) -> None:
        if not self.tokens or len(self.tokens) != len(self.flops_per_s):
            raise ValueError("ComputeCurve needs one rate per token count, at least one")
        if list(self.tokens) != sorted(self.tokens) or min(self.flops_per_s) <= 0:
            raise ValueError("ComputeCurve tokens must ascend and rates be positive")

    def rate(self, tokens) -> np.ndarray:
        """Interpolated in log-log space between measured token counts, held below the smallest. Above the
        largest, a call's time grows by the last two points' seconds per token (`_beyond_largest`)."""
        tokens = np.asarray(tokens, dtype=np.float64)
        inside = np.exp(np.interp(np.log(tokens), np.log(self.tokens), np.log(self.flops_per_s)))
        return np.where(tokens > self.tokens[-1], self._beyond_largest(tokens), inside)

    def _beyond_largest(self, tokens: np.ndarray) -> np.ndarray:
        """A call costs a fixed part (launches, DTensor's dispatch, a collective's latency) plus a part per
        token. Holding the rate prices a larger call as if all of it grew with the tokens: the micro-batch
        of 2,048 tokens of a TP-4 layer, its rate still rising 2.2x from 256 to 1,024 tokens, was priced 50%
        slow. Time per unit of work is t = n / rate; past the largest count it grows by the last two
        points' slope (a rate that approaches that marginal rate), held where the slope is not positive."""
        held = np.full_like(tokens, self.flops_per_s[-1])
        if len(self.tokens) < 2:
            return held
        (n1, n2), (r1, r2) = self.tokens[-2:], self.flops_per_s[-2:]
        t1, t2 = n1 / r1, n2 / r2
        per_token = (t2 - t1) / (n2 - n1)
        if per_token <= 0:
            return held
        return tokens / (t2 + per_token * (np.maximum(tokens, n2) - n2))

    @property
    def best(self) -> float:
        return max(self.flops_per_s)


@dataclass(kw_only=True, frozen=True)
class ShardingCost:
    """Seconds per layer and micro-batch that sharding the weights over a data-parallel group adds
    (ZeRO-3 / FSDP2's gathers and reduce-scatters, what compute did not hide), at several token counts."""

    tokens: tuple[int, ...]
    extra_s: tuple[float, ...]

    def __post_init__(self) -> None:
        if not self.tokens or len(self.tokens) != len(self.extra_s) or list(self.tokens) != sorted(self.tokens):
            raise ValueError("ShardingCost needs one figure per token count, token counts ascending")

    def seconds(self, tokens) -> np.ndarray:
        """Interpolated linearly in tokens, held outside the measured range, never below zero."""
        return np.maximum(np.interp(np.asarray(tokens, dtype=np.float64), self.tokens, self.extra_s), 0.0)


def shape_key(model: ModelSpec, tp: int) -> str:
    """What a layer's and the head's compute depends on: its local shapes under TP degree `tp`."""
    return (f"h{model.hidden}-q{model.num_heads // tp}x{model.head_size}-kv{model.kv_heads // tp}"
            f"-f{model.ffn_hidden // tp}{'g' if model.gated_mlp else ''}-s{model.seq_len}-v{model.vocab_size}"
            f"-{'rms' if model.rms_norm else 'ln'}-b{model.dtype_bytes}")


def sharding_key(model: ModelSpec, tp: int, dp: int, zero: int = 3) -> str:
    """ZeRO-3's cost per layer and micro-batch under `...-dp{dp}`; ZeRO-1/2's per layer and step under
    `...-dp{dp}-z{zero}`."""
    if zero not in (1, 2, 3):
        raise ValueError(f"zero={zero} is invalid: expected 1, 2 or 3")
    return f"{shape_key(model, tp)}-dp{dp}" + ("" if zero == 3 else f"-z{zero}")


def zero_stage_of(key: str) -> int:
    """The ZeRO stage a `sharding_key` was made for."""
    stage = key.rsplit("-dp", 1)[1].partition("-z")[2]
    return int(stage) if stage else 3


@dataclass(kw_only=True)
class ChipCalibration:
    """Compute curves of one chip model, keyed by `shape_key`."""

    chip: str
    peak_flops: float  # the descriptor's nominal peak, to find the chip from a stage's peak
    layer: dict[str, ComputeCurve] = field(default_factory=dict)
    head: dict[str, ComputeCurve] = field(default_factory=dict)
    # Shapes measured tensor-parallel (tp > 1): the slowest link tier their TP groups spanned. Their
    # curves hold the TP collectives of that tier; the cost model adds none on top of them.
    tp_tier: dict[str, int] = field(default_factory=dict)
    # Seconds of gradient clipping + AdamW per step for one layer's and for the head's parameters, on a
    # TP rank's share (DTensors when tp > 1), keyed like the curves.
    optimizer_s: dict[str, tuple[float, float]] = field(default_factory=dict)
    # What ZeRO-3 (FSDP2 beside TP, DeepSpeed without) over the data-parallel group of the other devices
    # adds per layer and micro-batch, and DeepSpeed's ZeRO-1/2 per layer and step (reducing the gradients
    # into partitions, stepping one, gathering the weights), keyed by `sharding_key` (the shapes, the
    # group's size and the stage).
    sharding: dict[str, ShardingCost] = field(default_factory=dict)


@dataclass(kw_only=True)
class Calibration:
    fingerprint: str
    backend: str
    chips: dict[str, ChipCalibration] = field(default_factory=dict)
    links: dict[int, LinkFit] = field(default_factory=dict)
    overlap: float | None = None
    optimizer_s_per_param: float | None = None
    step_overhead_s: float | None = None
    # How much faster a device computes while its host's other devices idle: 1.0 for accelerators,
    # up to devices / cores where simulated devices share a host's cores (a pipeline bubble then
    # lends its cores to the busy stages).
    host_sharing: float | None = None
    host_sharing_measured_at: float | None = None  # the share of devices busy when it was measured
    seconds: dict[str, float] = field(default_factory=dict)  # how long each probe took
    samples: list[dict[str, Any]] = field(default_factory=list)  # the collective timings the links were fitted to

    # ---- what the cost model asks ---------------------------------------------------------

    def chip_for_peak(self, peak_flops: float) -> ChipCalibration | None:
        for chip in self.chips.values():
            if np.isclose(chip.peak_flops, peak_flops, rtol=1e-9):
                return chip
        return None

    def curves(self, model: ModelSpec, tp: int, peak_flops: float) -> tuple[ComputeCurve, ComputeCurve] | None:
        chip = self.chip_for_peak(peak_flops)
        key = shape_key(model, tp)
        if chip is None or key not in chip.layer or key not in chip.head:
            return None
        return chip.layer[key], chip.head[key]

    def sharding_seconds(self, model: ModelSpec, tp: int, dp: int, peaks, tokens, zero: int = 3) -> np.ndarray | None:
        """Per token count, the measured seconds per layer that ZeRO-`zero` over `dp` devices adds on the
        slowest chip of `peaks` (per micro-batch for ZeRO-3, per step for ZeRO-1/2); None where some chip
        lacks it."""
        key = sharding_key(model, tp, dp, zero)
        found = [self.chip_for_peak(float(p)) for p in peaks]
        if dp < 2 or any(c is None or key not in c.sharding for c in found):
            return None
        return np.max([c.sharding[key].seconds(tokens) for c in found], axis=0)

    def optimizer_seconds(self, model: ModelSpec, tp: int, peaks) -> tuple[float, float] | None:
        """(per layer, head) optimizer seconds on the slowest chip of `peaks`, or None if not measured."""
        key = shape_key(model, tp)
        found = [self.chip_for_peak(float(p)) for p in peaks]
        if any(c is None or key not in c.optimizer_s for c in found):
            return None
        return max(c.optimizer_s[key][0] for c in found), max(c.optimizer_s[key][1] for c in found)

    def tensor_parallel_included(self, model: ModelSpec, tp: int, peaks, tier: int) -> bool:
        """Whether the curves of every chip in `peaks` already hold TP traffic over `tier` or faster."""
        key = shape_key(model, tp)
        chips = [self.chip_for_peak(float(p)) for p in peaks]
        return tp > 1 and all(c is not None and c.tp_tier.get(key, -1) >= tier for c in chips)

    def has_compute(self, model: ModelSpec, tps, peaks) -> bool:
        return all(self.curves(model, int(t), float(p)) is not None for t in tps for p in peaks)

    def measured_tps(self, model: ModelSpec, peaks, candidates) -> list[int]:
        """The TP degrees among `candidates` whose curves every chip of `peaks` has: the planner prices
        only those, since a nominal compute figure beside measured links mixes two scales."""
        return [t for t in candidates if self.has_compute(model, [t], peaks)]

    def link(self, tier: int) -> LinkFit | None:
        return self.links.get(int(tier))

    def measured_terms(self, model: ModelSpec | None = None, tps=(1,), peaks=()) -> list[str]:
        terms = [f"link {fit.tier_name}" for fit in sorted(self.links.values(), key=lambda f: f.tier)]
        if model is not None and peaks and self.has_compute(model, tps, peaks):
            terms.insert(0, "compute (layer and head FLOP/s per micro-batch and TP degree)")
            keys = {shape_key(model, int(t)) for t in tps}
            chips = [self.chip_for_peak(float(p)) for p in peaks]
            for stages, term in (((3,), "ZeRO-3 sharding (the engine's cost per layer)"),
                                 ((1, 2), "ZeRO-1/2 (DeepSpeed's cost per layer and step)")):
                if all(c is not None and any(k.rsplit("-dp", 1)[0] in keys and zero_stage_of(k) in stages
                                             for k in c.sharding) for c in chips):
                    terms.insert(len(terms) - len(self.links), term)
        terms += [name for name, value in (("overlap", self.overlap), ("optimizer", self.optimizer_s_per_param),
                                           ("step overhead", self.step_overhead_s),
                                           ("host sharing", self.host_sharing)) if value is not None]
        return terms

    # ---- storage ---------------------------------------------------------------------------

    def to_json(self) -> str:
        data = asdict(self)
        data["links"] = {str(tier): fit for tier, fit in data["links"].items()}
        data["format"] = FORMAT_VERSION
        return json.dumps(data, indent=1, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> Calibration:
        data: dict[str, Any] = json.loads(text)
        if data.pop("format", None) != FORMAT_VERSION:
            raise ValueError(f"calibration format is not {FORMAT_VERSION}; calibrate again")
        chips = {name: ChipCalibration(chip=c["chip"], peak_flops=c["peak_flops"],
                                       layer={k: _curve(v) for k, v in c["layer"].items()},
                                       head={k: _curve(v) for k, v in c["head"].items()},
                                       tp_tier={k: int(v) for k, v in c.get("tp_tier", {}).items()},
                                       optimizer_s={k: tuple(v) for k, v in c.get("optimizer_s", {}).items()},
                                       sharding={k: ShardingCost(tokens=tuple(v["tokens"]), extra_s=tuple(v["extra_s"]))
                                                 for k, v in c.get("sharding", {}).items()})
                 for name, c in data.pop("chips").items()}
        links = {int(tier): _link(fit) for tier, fit in data.pop("links").items()}
        return cls(chips=chips, links=links, **data)


def _link(data: dict[str, Any]) -> LinkFit:
    kinds = {kind: _link(fit) for kind, fit in data.pop("kinds", {}).items()}
    return LinkFit(**data, kinds=kinds)


def _curve(data: dict[str, Any]) -> ComputeCurve:
    return ComputeCurve(tokens=tuple(data["tokens"]), flops_per_s=tuple(data["flops_per_s"]))


# ---- which cluster, which groups ------------------------------------------------------------------


def graph_fingerprint(graph: ResourceGraph) -> str:
    """The hardware a calibration holds for: chips, node shapes, coordinates and network, not the
    Ray node ids (a restarted cluster of the same machines keeps its calibration)."""
    d = graph.devices
    digest = hashlib.sha256()
    for column in (d.node, d.island, d.rail, d.leaf, d.pod, d.profile, d.memory_gb, d.nic_gbps):
        digest.update(np.ascontiguousarray(column).tobytes())
    for profile in graph.profiles:
        digest.update(repr(dataclasses.replace(profile, name="")).encode())
    digest.update(repr(graph.network).encode())
    return digest.hexdigest()[:16]

