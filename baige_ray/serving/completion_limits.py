"""The bounds a completion or chat request must respect (serving/openai_api.py and the parsers beside it)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from baige_ray.api.validation import require_int, require_number


@dataclass(kw_only=True, frozen=True)
class CompletionLimits:
    """Bounds a completion or chat request must respect (they bound a replica's memory and time per
    request). `max_context` and `vocab_size` are the served model's, which the replica fills in: the
    parser then refuses a max_tokens beyond the context and token ids beyond the vocabulary.
    `max_logprobs`: the most log-probabilities per position a request may ask for (vLLM's
    `--max-logprobs`, 20 by default; -1: the whole vocabulary)."""

    max_body_bytes: int = 64 * 1024
    max_prompt_chars: int = 16384
    max_temperature: float = 10.0
    max_logprobs: int = 20
    max_context: int | None = None
    vocab_size: int | None = None

    def __post_init__(self) -> None:
        for name in ("max_body_bytes", "max_prompt_chars"):
            require_int("CompletionLimits", name, getattr(self, name), minimum=1)
        require_number("CompletionLimits", "max_temperature", self.max_temperature, minimum=0)
        if not math.isfinite(self.max_temperature):
            raise ValueError(
                f"CompletionLimits.max_temperature={self.max_temperature!r} is invalid: expected a finite number"
            )
        require_int("CompletionLimits", "max_logprobs", self.max_logprobs, minimum=-1)
        for name in ("max_context", "vocab_size"):
            if getattr(self, name) is not None:
                require_int("CompletionLimits", name, getattr(self, name), minimum=1)
