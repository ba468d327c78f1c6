"""A structured event log: one JSON line per controller or arbiter decision, with its reason.

Each record is flushed as soon as it is written, so a crash loses at most the line
being written; `read_events` skips such a truncated last line, and reopening the
log cuts it off before appending. Reopening also refills the in-memory ring from
the file, so a restarted controller still reports the events before its restart.
"""

from __future__ import annotations

import json
import operator
import threading
import time
from collections import deque
from pathlib import Path
from typing import Any

from baige_ray.api.validation import require_int

EVENT_KINDS = (
    "plan", "start", "failure", "eviction", "straggler", "resize", "recovered",
    "lend", "reclaim", "harvest", "unharvest", "rebalance", "checkpoint", "finished", "failed", "controller_restart",
    "arbiter_restart", "kv_handover", "engine_asleep", "engine_awake", "memory_return", "spare_lost",
)
# Fields some kinds must carry: the timeline plot and `baige-ray status` read them. A training job's
# resize says what training holds; what serving holds is the arbiter's to say (lend, reclaim).
DEVICE_FIELDS = ("train_devices", "infer_devices")
REQUIRED_FIELDS = {
    "resize": ("train_devices",),
    "lend": DEVICE_FIELDS,
    "reclaim": DEVICE_FIELDS,
    "unharvest": DEVICE_FIELDS,
    "failure": ("rank", "node_id"),
}
_RESERVED = ("time", "kind", "reason")


class EventLog:
    """Append-only JSON-lines event log plus a ring of the `keep` most recent events; thread-safe.

    `path=None` keeps events in memory only.
    """

    def __init__(self, path: str | Path | None, keep: int = 200):
        require_int("EventLog", "keep", keep, minimum=1)
        self.path = Path(path) if path is not None else None
        self._recent: deque[dict[str, Any]] = deque(maxlen=keep)
        self._lock = threading.Lock()
        self._file = None
        if self.path is not None:
            self._file = self._open_for_append(self.path)

    def _open_for_append(self, path: Path):
        path.parent.mkdir(parents=True, exist_ok=True)
        if path.exists():
            _cut_partial_last_line(path)
            self._recent.extend(read_events(path)[-self._recent.maxlen:])
        return path.open("a", encoding="utf-8")

    def record(self, kind: str, reason: str, **fields: Any) -> dict[str, Any]:
        """Append one event {"time", "kind", "reason", **fields}; returns the event as written."""
        _check_event(kind, reason, fields)
        event = {"time": time.time(), "kind": kind, "reason": reason, **fields}
        line = json.dumps(event, default=_to_json) + "\n"
        event = json.loads(line)  # what readers of the file will see (numpy scalars, paths made plain)
        with self._lock:
            if self._file is not None:
                self._file.write(line)
                self._file.flush()
            self._recent.append(event)
        return event

    def recent(self, n: int = 20) -> list[dict[str, Any]]:
        """The last `n` events, oldest first."""
        require_int("EventLog.recent", "n", n, minimum=0)
        with self._lock:
            return list(self._recent)[len(self._recent) - min(n, len(self._recent)):]

    def close(self) -> None:
        with self._lock:
            if self._file is not None:
                self._file.close()
                self._file = None

    def __enter__(self) -> EventLog:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __getstate__(self) -> dict[str, Any]:
        raise TypeError("EventLog holds an open file and a lock; create it inside the process that records")


def read_events(path: str | Path) -> list[dict[str, Any]]:
    """Every event in a JSON-lines log; a truncated last line (a crash mid-write) is skipped."""
    text = Path(path).read_text(encoding="utf-8")
    lines = text.split("\n")
    complete, tail = lines[:-1], lines[-1]  # text written by EventLog always ends in "\n"
    events = []
    for number, line in enumerate(complete, start=1):
        if not line.strip():
            continue
        try:
            events.append(json.loads(line))
        except json.JSONDecodeError as error:
            raise ValueError(f"{path}: line {number} is not a JSON event: {error}") from error
    if tail.strip():
        try:  # a last line without its newline is whole only if it parses
            events.append(json.loads(tail))
        except json.JSONDecodeError:
            pass
    return events


def _check_event(kind: str, reason: str, fields: dict[str, Any]) -> None:
    if kind not in EVENT_KINDS:
        raise ValueError(f"event kind={kind!r} is invalid: expected one of {', '.join(EVENT_KINDS)}")
    if not isinstance(reason, str):
        raise ValueError(f"event reason={reason!r} is invalid: expected a string")
    reserved = [name for name in _RESERVED if name in fields]
    if reserved:
        raise ValueError(f"event fields {reserved} are invalid: {', '.join(_RESERVED)} are set by the log")
    missing = [name for name in REQUIRED_FIELDS.get(kind, ()) if name not in fields]
    if missing:
        raise ValueError(f"{kind} event fields {missing} are missing: {kind} events carry "
                         f"{', '.join(REQUIRED_FIELDS[kind])}")
    for name in DEVICE_FIELDS:
        if name in fields and not _is_count(fields[name]):
            raise ValueError(f"event field {name}={fields[name]!r} is invalid: expected an integer >= 0")


def _is_count(value: Any) -> bool:
    """An int >= 0 (numpy integers included, bools and floats not)."""
    if isinstance(value, (bool, float)):
        return False
    try:
        return operator.index(value) >= 0
    except TypeError:
        return False


def _cut_partial_last_line(path: Path) -> None:
    """Drop bytes after the last newline, so the next record starts on a line of its own."""
    with path.open("rb+") as file:
        data = file.read()
        if data and not data.endswith(b"\n"):
            file.truncate(data.rfind(b"\n") + 1)


def _to_json(value: Any) -> Any:
    if hasattr(value, "tolist"):  # numpy / torch scalars and arrays
        return value.tolist()
    return str(value)
