"""1F1B in which a stage never waits for its own sends, and upstream stages run ahead.

torch's `Schedule1F1B` fuses each send with the next receive and waits for both. On
gloo a send completes only once the peer has posted the matching receive, so every
micro-batch a stage also waits for its neighbour to reach that point: with stages of
equal time (which a speed-proportional split aims for) the hand-over latency lands on
the critical path once per micro-batch, and any hiccup of one stage stalls the other.

`ScheduleRunAhead1F1B` runs the same per-stage order on torch's schedule runtime, where
sends are only waited for at the end of the step and each receive is posted as soon as
the sender's forward or backward is scheduled. Every stage but the last also keeps
`run_ahead` more forwards in flight than 1F1B's p - r, so the next stage finds its input
received before it asks, and a first stage that is the slowest one never idles waiting
for the first gradient. Forwards and backwards run in the same micro-batch order on each
stage as in 1F1B, so gradients are identical; the cost is `run_ahead` more micro-batches
of activations held on each non-last stage.
"""

from __future__ import annotations

from collections.abc import Callable

from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import _Action, _ComputationType, _PipelineScheduleRuntime

FORWARD = _ComputationType.FORWARD
BACKWARD = _ComputationType.FULL_BACKWARD


def run_ahead_1f1b_order(stage: int, num_stages: int, num_microbatches: int, run_ahead: int) -> list[tuple[str, int]]:
    """("F" | "B", micro-batch) in execution order for one stage: warm-up forwards, 1B1F, cool-down backwards."""
    extra = run_ahead if stage < num_stages - 1 else 0
    warmup = min(num_microbatches, num_stages - stage + extra)
    order = [("F", index) for index in range(warmup)]
    for index in range(num_microbatches):
        order.append(("B", index))
        if warmup + index < num_microbatches:
            order.append(("F", warmup + index))
    return order


class ScheduleRunAhead1F1B(_PipelineScheduleRuntime):
    """One stage per rank; `run_ahead` = 0 is 1F1B's order with non-blocking sends."""

    def __init__(self, stage: PipelineStage, num_microbatches: int, loss_fn: Callable, *, run_ahead: int = 1):
        super().__init__([stage], num_microbatches, loss_fn=loss_fn)
        kinds = {"F": FORWARD, "B": BACKWARD}
        self.pipeline_order = {
            rank: [
                _Action(rank, kinds[kind], index)
                for kind, index in run_ahead_1f1b_order(rank, self.pp_group_size, num_microbatches, run_ahead)
            ]
            for rank in range(self.pp_group_size)
        }
        self._prepare_schedule_with_comms(self.pipeline_order)
