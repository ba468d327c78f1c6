"""Each step's metrics as JSON lines beside the event log, so a restarted controller keeps the history.

Only the newest `RECENT_RECORDS` records stay in the controller's memory (what its status and deadlines
read); the whole history is the file's. A soak of 1,728 steps in 3 minutes grew the controller's resident
memory 7% by keeping every record: a job of a million steps would have held a gigabyte.
"""

from __future__ import annotations

import json
from collections import deque
from pathlib import Path

RECENT_RECORDS = 256
FORGET_FROM = "forget_from"  # a line {"forget_from": n}: the records of step n and later before it are void


class StepLog:
    """Append-only; `resume=True` reads back what an earlier incarnation of the controller wrote."""

    def __init__(self, path: Path, *, resume: bool):
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self._recent: deque[dict] = deque(read_steps(path) if resume else [], maxlen=RECENT_RECORDS)
        self._file = path.open("a" if resume else "w", encoding="utf-8")

    @property
    def records(self) -> list[dict]:
        """The newest records, in step order (at most RECENT_RECORDS)."""
        return list(self._recent)

    def all_records(self) -> list[dict]:
        """Every step's record, from the file, in step order."""
        return read_steps(self.path)

    def append(self, record: dict) -> None:
        self._recent.append(record)
        self._write(record)

    def keep_before(self, step: int) -> None:
        """Forget records of `step` and later: they are being done again."""
        self._recent = deque((record for record in self._recent if record["step"] < step), maxlen=RECENT_RECORDS)
        self._write({FORGET_FROM: step})

    def close(self) -> None:
        self._file.close()

    def _write(self, line: dict) -> None:
        self._file.write(json.dumps(line) + "\n")
        self._file.flush()


def read_steps(path: Path) -> list[dict]:
    """The records of a step log in step order: the last one of each step, none of those a later
    `keep_before` forgot (and nothing redid); a torn last line is skipped."""
    if not path.exists():
        return []
    by_step: dict[int, dict] = {}
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:  # the controller died mid-write
            continue
        if FORGET_FROM in record:
            by_step = {step: kept for step, kept in by_step.items() if step < record[FORGET_FROM]}
        else:
            by_step[record["step"]] = record
    return [by_step[step] for step in sorted(by_step)]
