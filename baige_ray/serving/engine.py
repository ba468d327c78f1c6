"""Continuous batching: requests join and leave the running batch at every step, any prompt lengths.

Each `step()` first admits waiting requests while the batch has room: a joining request's prompt
is prefilled on its own (one forward over its tokens, its first token sampled) and its cache joins
the batch's (`PaddedKVBatch`). Then one decode forward runs over every running row's newest token
and each row samples its next one. A row that samples end-of-text, reaches its token budget or is
cancelled leaves at once, freeing its slot for the next waiting request.

Each row samples with its own seeded generator (serving/sampling.py), so a request's tokens do not
depend on what it shares the batch with, up to floating-point summation order. Tokens go to the
request's `on_event` callback as they are sampled (the server streams them); it runs on the
engine's thread and must not block.

`submit` and `cancel` may be called from any thread; `step` from one thread only (engine_runner.py).
"""

from __future__ import annotations

import itertools
import threading
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from baige_ray.api.validation import require_int
from baige_ray.serving.causal_lm_generation import FinishReason, Generation, SamplingParams, fit_prompt
from baige_ray.serving.decoders import KVDecoder
from baige_ray.serving.kv_batch import PaddedKVBatch
from baige_ray.serving.sampling import sample_token, seeded_generator


@dataclass(frozen=True)
class TokenEvent:
    """A sampled token (`finish_reason` None), or the end of a request (`token` None)."""

    token: int | None
    finish_reason: FinishReason | None = None


EventSink = Callable[[TokenEvent], None]


class EngineFull(RuntimeError):
    """The waiting queue is full: the caller should answer 503 and ask the client to retry."""


@dataclass(kw_only=True)
class _Request:
    id: int
    prompt: list[int]
    params: SamplingParams
    on_event: EventSink
    budget: int
    generator: torch.Generator
    generated: int = 0
    last_token: int = 0


@dataclass(kw_only=True, frozen=True)
class EngineLimits:
    max_batch_size: int = 32  # rows decoded together
    max_waiting: int = 256  # requests queued for a slot; beyond that submit raises EngineFull

    def __post_init__(self) -> None:
        require_int("EngineLimits", "max_batch_size", self.max_batch_size, minimum=1)
        require_int("EngineLimits", "max_waiting", self.max_waiting, minimum=0)


class ContinuousBatchingEngine:
    def __init__(self, decoder: KVDecoder, *, eos_token_id: int | None, limits: EngineLimits = EngineLimits()):
        self.decoder, self.eos_token_id, self.limits = decoder, eos_token_id, limits
        self._waiting: deque[_Request] = deque()
        self._cancelled: set[int] = set()
        self._lock = threading.Lock()
        self._work = threading.Condition(self._lock)
        self._ids = itertools.count()
        self._running: list[_Request] = []
        self._cache = PaddedKVBatch()

    # -- any thread ---------------------------------------------------------------------------
    def submit(self, prompt: Sequence[int], params: SamplingParams, on_event: EventSink) -> int:
        """Queue a request; returns its id. Raises EngineFull when `max_waiting` are already queued."""
        if not prompt:
            raise ValueError("the prompt is empty: a request needs at least one token")
        fitted = fit_prompt(prompt, params.max_new_tokens, self.decoder.max_context)
        request = _Request(
            id=next(self._ids), prompt=fitted, params=params, on_event=on_event,
            budget=min(params.max_new_tokens, self.decoder.max_context - len(fitted)),
            generator=seeded_generator(params.seed),
        )
        with self._work:
            if len(self._waiting) >= self.limits.max_waiting:
                raise EngineFull(f"{len(self._waiting)} requests are already waiting for a slot")
            self._waiting.append(request)
            self._work.notify()
        return request.id

    def cancel(self, request_id: int) -> None:
        """Stop a request (its client went away); it gets no further events."""
        with self._work:
            self._cancelled.add(request_id)
            self._work.notify()

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def max_context(self) -> int:
        return self.decoder.max_context

    @property
    def num_running(self) -> int:
        return len(self._running)

    # -- the engine's thread --------------------------------------------------------------------
    def wait_for_work(self, timeout_s: float) -> None:
        """Sleep until a request arrives (or `timeout_s` passes) when nothing is queued or running."""
        with self._work:
            if not self._waiting and not self._running:
                self._work.wait(timeout_s)

    def step(self) -> bool:
        """Admit what fits, then decode one token for every running row; False when there was nothing to do."""
        self._drop_cancelled()
        admitted = self._admit()
        decoding = bool(self._running)
        if decoding:
            self._decode()
        return bool(admitted or decoding)

    def _drop_cancelled(self) -> None:
        with self._work:
            cancelled, self._cancelled = self._cancelled, set()
            if cancelled:
                self._waiting = deque(r for r in self._waiting if r.id not in cancelled)
        if cancelled and any(r.id in cancelled for r in self._running):
            self._keep_rows([i for i, r in enumerate(self._running) if r.id not in cancelled])

    def _admit(self) -> int:
        admitted = 0
        while len(self._running) < self.limits.max_batch_size:
            with self._work:
                if not self._waiting:
                    break
                request = self._waiting.popleft()
            admitted += 1
            self._prefill(request)
        return admitted

    def _prefill(self, request: _Request) -> None:
        length = len(request.prompt)
        tokens = torch.tensor([request.prompt], dtype=torch.long)
        logits, cache = self.decoder.forward(tokens, torch.arange(length)[None, :],
                                             torch.ones(1, length, dtype=torch.long), None)
        if self._emit(request, logits[0]) is None:
            self._running.append(request)
            self._cache.add(cache, length)

    def _decode(self) -> None:
        tokens = torch.tensor([[request.last_token] for request in self._running], dtype=torch.long)
        logits, cache = self.decoder.forward(tokens, self._cache.next_positions(), self._cache.attention_mask(1),
                                             self._cache.layers)
        self._cache.grow(cache)
        finished = [self._emit(request, logits[row]) is not None for row, request in enumerate(self._running)]
        if any(finished):
            self._keep_rows([row for row, done in enumerate(finished) if not done])

    def _keep_rows(self, rows: list[int]) -> None:
        self._running = [self._running[row] for row in rows]
        self._cache.keep(rows)

    def _emit(self, request: _Request, logits: torch.Tensor) -> FinishReason | None:
        """Sample the request's next token and report it; returns why it finished, if it did."""
        token = sample_token(logits, request.params.temperature, request.generator, request.params.top_k)
        request.last_token = token
        if token == self.eos_token_id:
            request.on_event(TokenEvent(None, "stop"))
            return "stop"
        request.generated += 1
        request.on_event(TokenEvent(token))
        if request.generated >= request.budget:
            request.on_event(TokenEvent(None, "length"))
            return "length"
        return None


def generate_all(engine: ContinuousBatchingEngine, prompts: Sequence[Sequence[int]],
                 params: Sequence[SamplingParams]) -> list[Generation]:
    """Run requests to completion on the calling thread (tests, warm-up): one Generation per prompt."""
    tokens: list[list[int]] = [[] for _ in prompts]
    reasons: list[FinishReason | None] = [None] * len(prompts)

    def sink(index: int) -> EventSink:
        def on_event(event: TokenEvent) -> None:
            if event.token is not None:
                tokens[index].append(event.token)
            else:
                reasons[index] = event.finish_reason
        return on_event

    for index, (prompt, request_params) in enumerate(zip(prompts, params)):
        engine.submit(prompt, request_params, sink(index))
    while engine.step():
        pass
    return [Generation(tokens=t, finish_reason=r) for t, r in zip(tokens, reasons)]
