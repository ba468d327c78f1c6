"""When a request's tokens came: what vLLM's server reports as time to first token and time per output
token, measured on the token events the engine hands the replica (a decode replica's too)."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from baige_ray.serving.engine import TokenEvent


@dataclass
class RequestTiming:
    submitted: float  # perf_counter when the replica took the request
    first_token: float | None = None
    last_token: float | None = None
    tokens: int = 0

    @property
    def time_to_first_token_s(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.submitted

    @property
    def time_per_output_token_s(self) -> float | None:
        """The mean gap between the request's tokens after the first (vLLM's
        request_time_per_output_token_seconds); None for fewer than two tokens."""
        if self.tokens < 2:
            return None
        return (self.last_token - self.first_token) / (self.tokens - 1)


async def timed_events(events: AsyncIterator[TokenEvent], timing: RequestTiming) -> AsyncIterator[TokenEvent]:
    """`events`, noting in `timing` when each token came; closing this closes `events` (cancelling the request)."""
    try:
        async for event in events:
            if event.token is not None or event.stop_token is not None:  # a stopping token counts, as in vLLM
                now = time.perf_counter()
                timing.first_token = timing.first_token or now
                timing.last_token = now
                timing.tokens += 1
            yield event
    finally:
        await events.aclose()
