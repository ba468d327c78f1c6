"""Persisting snapshots on a background thread without ever holding back training.

The training thread hands over a host-memory snapshot with `submit` and goes on.
One writer thread persists it. If snapshots arrive faster than the disk takes
them, only the newest waiting one is kept: at most one snapshot is being written
and at most one waits, so memory stays bounded and `submit` never blocks. A
failed write is recorded in `errors` (with a note naming its step) and logged;
it is never raised into the training thread, and the next snapshot is tried as usual.
`on_written` hears of every write, done or failed (the elastic job's events).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from baige_ray.checkpoint.store import write_checkpoint
from baige_ray.parallel.state import CanonicalState

logger = logging.getLogger(__name__)

WriteCheckpoint = Callable[..., Path]
# (step, the error or None, seconds the write took), called on the writer thread.
OnWritten = Callable[[int, BaseException | None, float], None]


@dataclass(frozen=True)
class _Submission:
    step: int
    state: CanonicalState
    meta: dict


class AsyncPersister:
    """`submit(step, state, meta)` returns at once; a writer thread persists the newest submission under `root`."""

    def __init__(self, root: Path, *, keep_last: int = 3, write: WriteCheckpoint = write_checkpoint,
                 on_written: OnWritten | None = None):
        if keep_last < 1:
            raise ValueError(f"AsyncPersister.keep_last={keep_last!r} is invalid: expected >= 1")
        self.root = Path(root)
        self.keep_last = keep_last
        self._write = write
        self._on_written = on_written
        self._condition = threading.Condition()
        self._pending: _Submission | None = None
        self._writing = False
        self._closed = False
        self._last_persisted_step: int | None = None
        self._errors: list[BaseException] = []
        self._num_coalesced = 0
        self._thread = threading.Thread(target=self._run, name=f"persister:{self.root.name}", daemon=True)
        self._thread.start()

    def submit(self, step: int, state: CanonicalState, meta: dict) -> None:
        """Hand over `state` (the persister owns it from now on); replaces a submission still waiting."""
        with self._condition:
            if self._closed:
                raise RuntimeError("AsyncPersister.submit after close()")
            if self._pending is not None:
                self._num_coalesced += 1
            self._pending = _Submission(step, state, meta)
            self._condition.notify_all()

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until nothing waits or is being written; False if `timeout` seconds passed first."""
        with self._condition:
            return self._condition.wait_for(lambda: self._pending is None and not self._writing, timeout)

    def close(self, timeout: float | None = None) -> bool:
        """Persist what was submitted, then stop the writer thread; True if it finished within `timeout`."""
        with self._condition:
            self._closed = True
            self._condition.notify_all()
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def __enter__(self) -> AsyncPersister:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    @property
    def last_persisted_step(self) -> int | None:
        with self._condition:
            return self._last_persisted_step

    @property
    def errors(self) -> list[BaseException]:
        with self._condition:
            return list(self._errors)

    @property
    def num_coalesced(self) -> int:
        """Submissions replaced by a newer one before they were written."""
        with self._condition:
            return self._num_coalesced

    def _next_submission(self) -> _Submission | None:
        with self._condition:
            self._condition.wait_for(lambda: self._pending is not None or self._closed)
            submission, self._pending = self._pending, None
            self._writing = submission is not None
            return submission

    def _run(self) -> None:
        while (submission := self._next_submission()) is not None:
            persisted = False
            try:
                persisted = self._persist(submission)
            finally:  # even if the thread dies, flush() must not wait forever
                with self._condition:
                    self._writing = False
                    if persisted:
                        self._last_persisted_step = submission.step
                    self._condition.notify_all()

    def _persist(self, submission: _Submission) -> bool:
        started = time.perf_counter()
        try:
            self._write(self.root, submission.step, submission.state, meta=submission.meta, keep_last=self.keep_last)
        except Exception as error:  # recorded for the owner to inspect; the thread keeps serving
            error.add_note(f"while persisting the checkpoint of step {submission.step} under {self.root}")
            logger.error("persisting step %d under %s failed: %r", submission.step, self.root, error)
            with self._condition:
                self._errors.append(error)
            self._report(submission.step, error, started)
            return False
        self._report(submission.step, None, started)
        return True

    def _report(self, step: int, error: BaseException | None, started: float) -> None:
        if self._on_written is None:
            return
        try:
            self._on_written(step, error, time.perf_counter() - started)
        except Exception:  # a listener's failure is not the checkpoint's
            logger.exception("the on_written listener failed for step %d", step)
