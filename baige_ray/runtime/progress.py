"""Progress bars for training: `fit`'s (loss and throughput, smoothed) and a `launch` job's."""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable
from typing import TextIO

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


class JobProgress:
    """The progress line of a running `launch` job, drawn by a daemon thread that polls `status` (the
    controller's status call) every `interval_s`: steps done, the last step's loss, tokens/s and MFU (with
    the device peak known) over the recent steps, workers, and the controller's phase whenever it is not running (recovering, resizing). It ends with the job."""

    def __init__(self, status: Callable[[], dict], num_steps: int, *, interval_s: float = 1.0,
                 file: TextIO | None = None):
        self._status, self._interval_s = status, interval_s
        self._bar = tqdm(total=num_steps, desc="train", unit="step", file=file or sys.stderr)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, name="job-progress", daemon=True)

    def start(self) -> JobProgress:
        self._thread.start()
        return self

    def close(self, final: dict | None = None) -> None:
        """Stop polling; draw `final` (the job's last status) before the line ends."""
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=2 * self._interval_s)
        if final is not None:
            self.show(final)
        self._bar.close()

    def show(self, status: dict) -> None:
        """Draw one status (what the thread does every interval)."""
        self._bar.n = min(status["step"], self._bar.total)
        postfix = {}
        if status.get("loss") is not None:
            postfix["loss"] = f"{status['loss']:.3f}"
        if status.get("tokens_per_s"):
            postfix["tok_s"] = f"{status['tokens_per_s']:,.0f}"
        if status.get("mfu") is not None:
            postfix["mfu"] = f"{status['mfu']:.1%}"
        postfix["workers"] = status["num_workers"]
        if status.get("persisted_step") is not None:
            postfix["ckpt"] = status["persisted_step"]
        if status["state"] != "running":
            postfix["state"] = status["state"]
        self._bar.set_postfix(postfix, refresh=False)
        self._bar.refresh()

    def _poll(self) -> None:
        while not self._stop.wait(self._interval_s):
            try:
                status = self._status()
            except Exception:  # the job ended (its controller is gone): nothing more to draw
                return
            self.show(status)
            if status["state"] in ("finished", "failed"):
                return


class StageProgress:
    """A progress line for work done in named stages, each counted (a plan's search, a benchmark's systems,
    a checkpoint's bytes): call it with (stage, done, total). Drawn on stderr only once the work has taken
    `delay_s`, so quick runs print nothing; a thread keeps the elapsed time moving while one long call
    (a checkpoint write) reports nothing."""

    def __init__(self, desc: str, *, delay_s: float = 1.0, file: TextIO | None = None, enabled: bool = True,
                 unit: str = "it", unit_scale: bool = False):
        self._desc, self._file, self._enabled = desc, file or sys.stderr, enabled
        self._unit, self._unit_scale = unit, unit_scale
        self._shown_after = time.monotonic() + delay_s
        self._latest: tuple[str, int, int] | None = None
        self._stage: str | None = None
        self._bar: tqdm | None = None
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._ticker = threading.Thread(target=self._tick, name="stage-progress", daemon=True)
        if enabled:
            self._ticker.start()

    def __call__(self, stage: str, done: int, total: int) -> None:
        with self._lock:
            self._latest = (stage, done, total)
            self._draw()

    def _draw(self) -> None:
        if self._latest is None or self._closed.is_set() or time.monotonic() < self._shown_after:
            return
        stage, done, total = self._latest
        if stage != self._stage:
            self._close_bar()
            self._stage = stage
            self._bar = tqdm(total=total, desc=f"{self._desc}: {stage}", file=self._file, unit=self._unit,
                             unit_scale=self._unit_scale, leave=False)
        self._bar.update(done - self._bar.n)  # tqdm redraws at most every 0.1 s

    def _tick(self) -> None:
        while not self._closed.wait(0.5):
            with self._lock:
                self._draw()
                if self._bar is not None:
                    self._bar.refresh()

    def _close_bar(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def close(self) -> None:
        self._closed.set()
        with self._lock:
            self._close_bar()

    def __enter__(self) -> StageProgress:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
