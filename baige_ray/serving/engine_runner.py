"""A replica's engine on its own thread, fed and read from the replica's asyncio loop.

The engine is the built-in continuous-batching one (serving/engine.py) or vLLM's
(serving/vllm_engine.py); both offer submit / cancel / step / wait_for_work. Forward passes run on
the engine's thread, so the event loop keeps accepting requests, streaming tokens and answering
health checks while the batch computes. Each request gets an asyncio queue that the engine's thread
fills with its `TokenEvent`s; a request whose reader goes away (the client disconnected) is
cancelled and leaves the batch at the next step. `between_steps` runs a function on the engine's
thread between two steps (vLLM's in-place weight update).

An engine that raises (a model the engine cannot run, a fault mid-batch) ends the thread: every
request it held, and every later one, fails at once with `EngineFailed` naming the engine's error,
`check` raises it (the replica's health check, so Ray Serve replaces the replica), and the hooks
given to `after_failure` run. Nothing waits for an engine that will never step again.

With prefill/decode disaggregation a prefill replica's runner drives a `PrefillEngine` and answers
`prefill` with the request's hand-off; a decode replica's runner continues it (`continued`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import itertools
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any, Protocol

from baige_ray.models.generation import TextCodec
from baige_ray.serving.causal_lm_generation import SamplingParams
from baige_ray.serving.engine import EventSink, PrefilledRequest, TokenEvent
from baige_ray.serving.generators import TextDelta, TextOutput
from baige_ray.serving.stop_strings import StopScanner
from baige_ray.serving.token_logprobs import TokenLogprobs

IDLE_WAIT_S = 0.05

FailureHook = Callable[["EngineFailed"], None]


class EngineFailed(RuntimeError):
    """The replica's engine raised (or its thread ended): it will not step again.

    `accepted`: the request was already in the engine when it failed (otherwise it arrived after)."""

    def __init__(self, reason: str, *, accepted: bool = True):
        super().__init__(f"the replica's engine failed: {reason}")
        self.reason, self.accepted = reason, accepted

    def __reduce__(self):  # to other processes (a deployment handle's caller, Serve's health check) as it is
        return type(self), (self.reason,), {"accepted": self.accepted}


class Engine(Protocol):
    max_context: int
    context_limit: str | None  # why max_context is below the model's context (a KV memory budget), or None

    def submit(self, prompt: list[int], params: SamplingParams, on_event: EventSink) -> Any: ...

    def cancel(self, request_id: Any) -> None: ...

    def step(self) -> bool: ...

    def wait_for_work(self, timeout_s: float) -> None: ...

    def interrupt_wait(self) -> None: ...


class EngineRunner:
    def __init__(self, engine: Engine, codec: TextCodec):
        self.engine, self.codec = engine, codec
        self._calls: queue.SimpleQueue = queue.SimpleQueue()
        self.busy_s = 0.0  # time spent stepping, read and reset by the replica's load reports
        self.failure: str | None = None  # the engine's error, once it raised
        self._failure_lock = threading.Lock()
        self._waiters: dict[int, FailureHook] = {}  # requests in the engine, told when it fails
        self._waiter_ids = itertools.count()
        self._failure_hooks: list[Callable[[str], None]] = []
        self._stop = threading.Event()
        self._retiring = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="baige-engine", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        try:
            self._step_until_stopped()
        except BaseException as error:  # the engine is unusable: fail its requests rather than leave them waiting
            self._fail(f"{type(error).__name__}: {error}")

    def _step_until_stopped(self) -> None:
        while not self._stop.is_set():
            self._run_calls()
            started = time.perf_counter()
            if self.engine.step():
                self.busy_s += time.perf_counter() - started
            elif self._retiring.is_set():
                return
            else:
                self.engine.wait_for_work(IDLE_WAIT_S)

    # -- failure ---------------------------------------------------------------------------------
    def _fail(self, reason: str) -> None:
        with self._failure_lock:
            self.failure = reason
            waiters, self._waiters = list(self._waiters.values()), {}
            hooks = list(self._failure_hooks)
        for tell in waiters:
            tell(EngineFailed(reason))
        while not self._calls.empty():  # between_steps calls that will never run
            _, future = self._calls.get()
            future.set_exception(EngineFailed(reason))
        for hook in hooks:
            hook(reason)

    def after_failure(self, hook: Callable[[str], None]) -> None:
        """Call `hook(reason)` once the engine has failed (at once if it already has), on the engine's thread."""
        with self._failure_lock:
            if self.failure is None:
                self._failure_hooks.append(hook)
                return
        hook(self.failure)

    def check(self) -> None:
        """Raises EngineFailed when the engine raised, or its thread ended without being told to."""
        if self.failure is not None:
            raise EngineFailed(self.failure, accepted=False)
        if not self._thread.is_alive() and not (self._stop.is_set() or self._retiring.is_set()):
            raise EngineFailed("the engine's thread ended", accepted=False)

    def _watch(self, tell: FailureHook) -> int:
        """Register a request that `tell` fails if the engine fails; raises EngineFailed if it has."""
        with self._failure_lock:
            if self.failure is not None:
                raise EngineFailed(self.failure, accepted=False)
            key = next(self._waiter_ids)
            self._waiters[key] = tell
        return key

    def _unwatch(self, key: int) -> None:
        with self._failure_lock:
            self._waiters.pop(key, None)

    def _run_calls(self) -> None:
        while not self._calls.empty():
            function, future = self._calls.get()
            try:
                future.set_result(function())
            except BaseException as error:  # handed to the awaiting caller
                future.set_exception(error)

    async def between_steps(self, function: Callable[[], Any]) -> Any:
        """Run `function` on the engine's thread between two steps; returns its result."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._failure_lock:  # a failed engine's calls are failed by _fail, which takes this lock first
            if self.failure is not None:
                raise EngineFailed(self.failure, accepted=False)
            self._calls.put((function, future))
        self.engine.interrupt_wait()  # an idle engine would see the call only when its wait ended (50 ms)
        return await asyncio.wrap_future(future)

    def retire(self) -> None:
        """Finish what was submitted (on these weights), then stop the thread."""
        self._retiring.set()

    def stop(self) -> None:
        self._stop.set()

    def join(self) -> None:
        """Wait until the engine's thread has ended (after `retire` or `stop`)."""
        self._thread.join()

    async def tokens(self, prompt: list[int], params: SamplingParams) -> AsyncIterator[TokenEvent]:
        """The request's events as they are sampled; raises EngineFull when the queue is full, EngineFailed
        when the engine failed (before or during the request)."""
        async for event in self._events(lambda deliver: self.engine.submit(prompt, params, deliver)):
            yield event

    async def continued(self, prefilled: PrefilledRequest) -> AsyncIterator[TokenEvent]:
        """A request another engine prefilled: its first token, then the rest as this engine decodes
        them; raises EngineFull when the queue is full."""
        if prefilled.finish_reason is not None:
            for event in prefilled.first_events():
                yield event
            return
        async for event in self._events(lambda deliver: self.engine.submit_prefilled(prefilled, deliver),
                                        first=prefilled.first_events()):
            yield event

    async def prefill(self, prompt: list[int], params: SamplingParams, known_tokens: int = 0) -> PrefilledRequest:
        """The request's hand-off once a PrefillEngine ran its prompt (without the first `known_tokens` tokens'
        keys and values); raises EngineFull when the queue is full, EngineFailed when the engine failed."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future = loop.create_future()

        def settle(prefilled: PrefilledRequest) -> None:
            if not future.done():  # not cancelled meanwhile
                future.set_result(prefilled)

        def deliver(prefilled: PrefilledRequest) -> None:
            with contextlib.suppress(RuntimeError):  # the replica's loop is closing: nobody is waiting any more
                loop.call_soon_threadsafe(settle, prefilled)

        def fail(error: EngineFailed) -> None:
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(lambda: future.done() or future.set_exception(error))

        key, request_id = self._watch(fail), None
        try:
            request_id = self.engine.submit(prompt, params, deliver, known_tokens)
            return await future
        except asyncio.CancelledError:  # the caller went away: its prompt need not run
            if request_id is not None:
                self.engine.cancel(request_id)
            raise
        finally:
            self._unwatch(key)

    async def _events(self, submit: Callable[[EventSink], Any],
                      first: Sequence[TokenEvent] = ()) -> AsyncIterator[TokenEvent]:
        """Submit through `submit(deliver)`, then yield `first` and the events the engine delivers."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[TokenEvent | EngineFailed] = asyncio.Queue()

        def deliver(event: TokenEvent | EngineFailed) -> None:
            try:
                loop.call_soon_threadsafe(queue.put_nowait, event)
            except RuntimeError:  # the replica's loop is closing: nobody is reading any more
                pass

        key = self._watch(deliver)  # before submitting: a failure from then on reaches this request
        request_id, finished = None, False
        try:
            request_id = submit(deliver)
            for event in first:
                yield event
            while not finished:
                event = await queue.get()
                if isinstance(event, EngineFailed):
                    raise event
                finished = event.token is None
                yield event
        finally:
            self._unwatch(key)
            if request_id is not None and not finished:
                self.engine.cancel(request_id)

    async def text(self, prompt: list[int], params: SamplingParams,
                   events: AsyncIterator[TokenEvent] | None = None) -> AsyncIterator[TextDelta | TextOutput]:
        """Text deltas as they are decoded, cut at the request's first stop string (`params.stop`, kept with
        `include_stop_str_in_output`; none ends within the first `min_tokens` tokens, as in vLLM); last, the
        whole TextOutput. A request asking for log-probabilities gets a delta per token, with its figures.

        The tokens are the request's own on this engine, or `events` (a disaggregated request's)."""
        decoder = self.codec.decoder(params.skip_special_tokens)
        scanner = StopScanner(params.stop, include=params.include_stop_str_in_output)
        figures = _Figures()
        finish_reason, stop_sampled = "length", False
        tokens: list[int] = []
        unsent = 0  # how many of `tokens` no delta has carried yet
        events = self.tokens(prompt, params) if events is None else events
        async with contextlib.aclosing(events) as events:  # closing cancels the request
            async for event in events:
                figures.take(event)
                if event.token is None:
                    finish_reason = event.finish_reason or "length"
                    stop_sampled = event.stop_token is not None
                    break
                tokens.append(event.token)
                delta = scanner.push(decoder.push(event.token), search=len(tokens) > params.min_tokens)
                if delta or figures.pending:
                    yield figures.delta(delta, len(tokens), tuple(tokens[unsent:]))
                    unsent = len(tokens)
                if scanner.stopped:
                    break
        if tail := scanner.push(decoder.flush(), search=len(tokens) > params.min_tokens) + scanner.flush():
            yield TextDelta(tail, completion_tokens=len(tokens), token_ids=tuple(tokens[unsent:]))
        if scanner.stopped:
            finish_reason = "stop"
        # A sampled stopping token (end of text, a stop token id) has no text but counts, as vLLM counts it.
        yield TextOutput(scanner.text[:scanner.sent], len(prompt), len(tokens) + stop_sampled, finish_reason,
                         logprobs=tuple(figures.every) if params.num_logprobs is not None else None,
                         prompt_logprobs=figures.prompt, token_ids=tuple(tokens))


class _Figures:
    """A request's log-probabilities as its events bring them: every token's, those not yet sent with a
    delta (the stopping token's go only with the whole output), and the prompt's."""

    def __init__(self) -> None:
        self.every: list[TokenLogprobs] = []
        self.pending: list[TokenLogprobs] = []
        self.prompt = self._prompt_unsent = None

    def take(self, event: TokenEvent) -> None:
        if event.prompt_logprobs is not None:
            self.prompt = self._prompt_unsent = event.prompt_logprobs
        if event.logprobs is not None:
            self.every.append(event.logprobs)
            if event.token is not None:
                self.pending.append(event.logprobs)

    def delta(self, text: str, generated: int, token_ids: tuple[int, ...]) -> TextDelta:
        sent = TextDelta(text, tuple(self.pending), self._prompt_unsent, completion_tokens=generated,
                         token_ids=token_ids)
        self.pending, self._prompt_unsent = [], None
        return sent
