"""Stop strings: generated text is cut at the first one (kept, with vLLM's `include_stop_str_in_output`),
whole or as it streams. Used for either engine, on the decoded text (engine_runner.py)."""

from __future__ import annotations


def find_stop(text: str, stop: tuple[str, ...], start: int = 0) -> tuple[int, int] | None:
    """(where, how long) the earliest stop string found in `text` from `start` begins, or None."""
    found = [(index, len(s)) for index, s in ((text.find(s, start), s) for s in stop if s) if index >= 0]
    return min(found) if found else None


def apply_stop(text: str, stop: tuple[str, ...], *, include: bool = False) -> tuple[str, bool]:
    """`text` cut before the earliest occurrence of any stop string (after it with `include`), and whether
    one occurred."""
    found = find_stop(text, stop)
    if found is None:
        return text, False
    index, length = found
    return text[: index + length if include else index], True


class StopScanner:
    """Cuts streamed text at the first stop string, holding back a tail that may be a stop's beginning."""

    def __init__(self, stop: tuple[str, ...], *, include: bool = False):
        self.stop, self.include, self.text, self.sent, self.stopped = stop, include, "", 0, False
        self._hold = max((len(s) for s in stop), default=1) - 1

    def push(self, delta: str, *, search: bool = True) -> str:
        """The text now safe to send; after a stop string appeared (`stopped`), nothing more. With `search`
        false (vLLM's `min_tokens` not reached yet) no stop string ends in `delta`."""
        if self.stopped:
            return ""
        # Only the new text, and the tail before it a stop string could have begun in, is searched again.
        start = max(0, len(self.text) - self._hold)
        self.text += delta
        found = find_stop(self.text, self.stop, start) if search else None
        if found is not None:
            self.stopped = True
            end = found[0] + (found[1] if self.include else 0)
        else:
            end = max(self.sent, len(self.text) - self._hold)
        out, self.sent = self.text[self.sent:end], end
        return out

    def flush(self) -> str:
        """What is held back, once the output has ended without a stop string."""
        if self.stopped:
            return ""
        out, self.sent = self.text[self.sent:], len(self.text)
        return out
