"""A plan as readable text (`PlacementPlan.explain`) and as JSON-ready data (`to_dict`)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from baige_ray.planner.explain import LABELS

if TYPE_CHECKING:
    from baige_ray.planner.plan import PlacementPlan


def explain_text(plan: PlacementPlan) -> str:
    model = plan.model
    fullest = int(np.argmax(np.array(plan.memory_by_stage_gb) / np.array(plan.usable_memory_by_stage_gb)))
    lines = [
        f"{model.name} ({model.num_params / 1e9:.1f}B params) on {plan.num_ranks} devices of {plan.cluster!r}",
        f"  layout     tp={plan.tp} pp={plan.pp} dp={plan.dp}{_cp_text(plan)} ep={plan.ep}  ZeRO-{plan.zero_stage}  "
        f"micro-batch {plan.micro_batch_size} x {plan.num_micro_batches}  recompute={plan.recompute}  "
        f"mapping {plan.mapping}",
        f"  step       {plan.step_time_s:.4g} s predicted, MFU {plan.mfu:.1%}",
        "  breakdown  " + ", ".join(f"{LABELS[k]} {v:.3g} s" for k, v in plan.breakdown_s.items() if v > 0),
        "  exposed    " + (", ".join(f"{name.replace('_', ' ')} {t['exposed_s']:.3g} of {t['total_s']:.3g} s"
                                     for name, t in plan.exposure_s.items() if t["total_s"] > 0) or "no traffic"),
        f"  memory     {plan.memory_by_stage_gb[fullest]:.1f} GB per device on the fullest stage {fullest} "
        f"(usable {plan.usable_memory_by_stage_gb[fullest]:.1f} GB)",
        "  links      " + ", ".join(f"{dim} on {link.tier_name} ({link.bandwidth / 1e9:.0f} GB/s)"
                                    for dim, link in plan.links.items() if link.tier >= 0),
    ]
    lines.append("  pricing    " + pricing_text(plan))
    if plan.context_parallel_reason:
        lines.append(f"  context    cp={plan.cp} ({plan.cp_kind}): {plan.context_parallel_reason}")
    if plan.pp > 1:
        layers = ", ".join(f"{n}x{chip}" for n, chip in zip(plan.stage_layers, plan.stage_chips))
        spread = 1 - min(plan.stage_time_s) / max(plan.stage_time_s)
        lines.append(f"  stages     layers {layers}; stage times within {spread:.1%} of the slowest")
    if plan.alternatives:
        lines.append("  alternatives (why they lost):")
        lines += [f"    {alt.describe()}: {alt.why_lost}" for alt in plan.alternatives]
    return "\n".join(lines)


def _cp_text(plan: PlacementPlan) -> str:
    return f" cp={plan.cp} ({plan.cp_kind})" if plan.cp > 1 else ""


def pricing_text(plan: PlacementPlan) -> str:
    """Which of the cost model's figures were measured on this cluster and which are nominal."""
    calibration = plan.options.calibration
    if calibration is None:
        reason = plan.search_stats.get("calibration_ignored") or "no calibration of this cluster; run `baige-ray calibrate`"
        return f"nominal constants ({reason})"
    peaks = tuple(chip.peak_flops for chip in calibration.chips.values())
    measured = calibration.measured_terms(plan.model, (plan.tp,), peaks)
    nominal = [term for term, found in (("compute", any(t.startswith("compute") for t in measured)),
                                         ("link tiers", any(t.startswith("link") for t in measured)),
                                         ("overlap", "overlap" in measured)) if not found]
    return ("measured " + ", ".join(measured) + ("; nominal " + ", ".join(nominal) if nominal else "")
            + f" (calibration {calibration.fingerprint})")


def plan_to_dict(plan: PlacementPlan, *, max_ranks: int = 4096) -> dict[str, Any]:
    """Everything but the per-rank arrays of very large plans (which would swamp a terminal)."""
    data: dict[str, Any] = {
        "model": plan.model.name, "cluster": plan.cluster, "num_ranks": plan.num_ranks,
        "tp": plan.tp, "pp": plan.pp, "dp": plan.dp, "ep": plan.ep, "cp": plan.cp, "cp_kind": plan.cp_kind,
        "context_parallel_reason": plan.context_parallel_reason, "zero_stage": plan.zero_stage,
        "micro_batch_size": plan.micro_batch_size, "num_micro_batches": plan.num_micro_batches,
        "recompute": plan.recompute, "mapping": plan.mapping, "step_time_s": plan.step_time_s,
        "mfu": plan.mfu, "breakdown_s": plan.breakdown_s, "exposure_s": plan.exposure_s, "memory_per_device_gb": plan.memory_per_device_gb,
        "memory_by_stage_gb": list(plan.memory_by_stage_gb), "stage_layers": list(plan.stage_layers),
        "stage_chips": list(plan.stage_chips), "stage_time_s": list(plan.stage_time_s),
        "links": {dim: {"tier": link.tier_name, "bandwidth_gb_per_s": link.bandwidth / 1e9,
                        "latency_us": link.latency * 1e6} for dim, link in plan.links.items()},
        "pricing": pricing_text(plan),
        "alternatives": [{"layout": alt.describe(), "step_time_s": alt.step_time_s, "why_lost": alt.why_lost}
                         for alt in plan.alternatives],
        "search": {k: (float(v) if isinstance(v, (float, np.floating)) else v) for k, v in plan.search_stats.items()},
    }
    if plan.num_ranks <= max_ranks:
        data["rank_to_device"] = plan.rank_to_device.tolist()
    return data
