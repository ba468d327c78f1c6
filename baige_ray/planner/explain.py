"""Per-step time breakdown of one candidate, and plain-language reasons one candidate loses to another."""

from __future__ import annotations

import numpy as np

from baige_ray.planner.evaluate import Evaluation

COMPONENTS = ("compute", "tensor_parallel", "expert_all_to_all", "context_parallel", "pipeline_p2p", "pipeline_bubble",
              "data_parallel_exposed", "optimizer_and_framework")
LABELS = {"compute": "compute", "tensor_parallel": "TP all-reduce", "expert_all_to_all": "EP all-to-all",
          "context_parallel": "CP key-value exchange",
          "pipeline_p2p": "pipeline send/recv", "pipeline_bubble": "pipeline bubble",
          "data_parallel_exposed": "exposed DP/ZeRO traffic", "optimizer_and_framework": "optimizer and framework"}


def breakdown(evaluation: Evaluation, row: int = 0) -> dict[str, float]:
    """Seconds per step by cause: the bottleneck stage's m micro-batches, the bubble, exposed DP time."""
    times = evaluation.times
    total = times.total[row]
    bottleneck = int(np.argmax(total))
    m = float(evaluation.num_micro_batches[row])

    def at(values: np.ndarray) -> float:
        return float(np.broadcast_to(values, times.total.shape)[row, bottleneck]) * m

    return {
        "compute": at(times.forward + times.backward),
        "tensor_parallel": at(times.tp),
        "expert_all_to_all": at(times.ep),
        "context_parallel": at(times.cp),
        "pipeline_p2p": at(times.pp),
        "pipeline_bubble": float(evaluation.pipeline_s[row] - m * total[bottleneck]),
        "data_parallel_exposed": float(evaluation.dp_exposed_s[row]),
        "optimizer_and_framework": float(evaluation.framework_s[row]),
    }


def exposure(evaluation: Evaluation, row: int = 0) -> dict[str, dict[str, float]]:
    """Per communication term, seconds per step in all and the part nothing hides. TP, EP and
    pipeline traffic sit on the critical path (all exposed); DP / ZeRO traffic overlaps compute."""
    parts = breakdown(evaluation, row)
    on_path = {name: {"total_s": parts[name], "exposed_s": parts[name]}
               for name in ("tensor_parallel", "expert_all_to_all", "context_parallel", "pipeline_p2p")}
    return {**on_path, "data_parallel": {"total_s": float(evaluation.dp_total_s[row]),
                                         "exposed_s": float(evaluation.dp_exposed_s[row])}}


def why_lost(winner: dict[str, float], loser: dict[str, float], winner_step: float, loser_step: float) -> str:
    """'+12.0% step time: pipeline bubble +0.31 s, TP all-reduce +0.05 s' (largest differences first)."""
    deltas = sorted(((loser[k] - winner[k], k) for k in COMPONENTS), reverse=True)
    worse = [f"{LABELS[k]} {d:+.3g} s" for d, k in deltas if d > 1e-3 * winner_step][:3]
    better = [f"{LABELS[k]} {d:+.3g} s" for d, k in deltas[::-1] if d < -1e-3 * winner_step][:1]
    change = (loser_step / winner_step - 1) * 100 if winner_step > 0 else float("inf")
    text = f"{change:+.1f}% step time"
    if worse:
        text += ": " + ", ".join(worse)
    if better:
        text += " (gains " + ", ".join(better) + ")"
    return text
