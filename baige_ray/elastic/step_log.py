"""Each step's metrics as JSON lines beside the event log, so a restarted controller keeps the history."""

from __future__ import annotations

import json
from pathlib import Path


class StepLog:
    """Append-only; `resume=True` reads back what an earlier incarnation of the controller wrote."""

    def __init__(self, path: Path, *, resume: bool):
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self.records = read_steps(path) if resume else []
        self._file = path.open("a" if resume else "w", encoding="utf-8")

    def append(self, record: dict) -> None:
        self.records.append(record)
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()

    def keep_before(self, step: int) -> None:
        """Forget records of `step` and later: they are being done again (the file keeps them; readers take the last)."""
        self.records = [record for record in self.records if record["step"] < step]

    def close(self) -> None:
        self._file.close()


def read_steps(path: Path) -> list[dict]:
    """The records of a step log, the last one of each step winning, in step order; a torn last line is skipped."""
    if not path.exists():
        return []
    by_step: dict[int, dict] = {}
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:  # the controller died mid-write
            continue
        by_step[record["step"]] = record
    return [by_step[step] for step in sorted(by_step)]
