"""A progress bar for training: loss and throughput, smoothed."""

from __future__ import annotations

import sys

from tqdm.auto import tqdm

from baige_ray.api.result import StepMetrics


class TrainingProgress:
    def __init__(self, num_steps: int, *, enabled: bool = True, smoothing: float = 0.9):
        self._bar = tqdm(total=num_steps, desc="train", unit="step", disable=not enabled, file=sys.stderr)
        self._smoothing = smoothing
        self._loss: float | None = None
        self._tokens_per_s: float | None = None

    def update(self, metrics: StepMetrics) -> None:
        self._loss = self._smooth(self._loss, metrics.loss)
        self._tokens_per_s = self._smooth(self._tokens_per_s, metrics.tokens_per_s)
        self._bar.set_postfix(loss=f"{self._loss:.3f}", tok_s=f"{self._tokens_per_s:,.0f}", refresh=False)
        self._bar.update(1)

    def _smooth(self, previous: float | None, value: float) -> float:
        return value if previous is None else self._smoothing * previous + (1 - self._smoothing) * value

    def __enter__(self) -> TrainingProgress:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._bar.close()
