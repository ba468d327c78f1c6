"""A replica's engine on its own thread, fed and read from the replica's asyncio loop.

The engine is the built-in continuous-batching one (serving/engine.py) or vLLM's
(serving/vllm_engine.py); both offer submit / cancel / step / wait_for_work. Forward passes run on
the engine's thread, so the event loop keeps accepting requests, streaming tokens and answering
health checks while the batch computes. Each request gets an asyncio queue that the engine's thread
fills with its `TokenEvent`s; a request whose reader goes away (the client disconnected) is
cancelled and leaves the batch at the next step. `between_steps` runs a function on the engine's
thread between two steps (vLLM's in-place weight update).

With prefill/decode disaggregation a prefill replica's runner drives a `PrefillEngine` and answers
`prefill` with the request's hand-off; a decode replica's runner continues it (`continued`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

from baige_ray.serving.causal_lm_generation import SamplingParams
from baige_ray.serving.engine import EventSink, TokenEvent
from baige_ray.serving.generators import TextCodec, TextOutput
from baige_ray.serving.openai_api import StopScanner

if TYPE_CHECKING:
    from baige_ray.serving.prefill import PrefilledRequest

IDLE_WAIT_S = 0.05


class Engine(Protocol):
    max_context: int

    def submit(self, prompt: list[int], params: SamplingParams, on_event: EventSink) -> Any: ...

    def cancel(self, request_id: Any) -> None: ...

    def step(self) -> bool: ...

    def wait_for_work(self, timeout_s: float) -> None: ...


class EngineRunner:
    def __init__(self, engine: Engine, codec: TextCodec):
        self.engine, self.codec = engine, codec
        self._calls: queue.SimpleQueue = queue.SimpleQueue()
        self.busy_s = 0.0  # time spent stepping, read and reset by the replica's load reports
        self._stop = threading.Event()
        self._retiring = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="baige-engine", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.is_set():
            self._run_calls()
            started = time.perf_counter()
            if self.engine.step():
                self.busy_s += time.perf_counter() - started
            elif self._retiring.is_set():
                return
            else:
                self.engine.wait_for_work(IDLE_WAIT_S)

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
        self._calls.put((function, future))
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
        """The request's events as they are sampled; raises EngineFull when the queue is full."""
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

    async def prefill(self, prompt: list[int], params: SamplingParams) -> PrefilledRequest:
        """The request's hand-off once a PrefillEngine ran its prompt; raises EngineFull when the queue is full."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future = loop.create_future()

        def settle(prefilled: PrefilledRequest) -> None:
            if not future.done():  # not cancelled meanwhile
                future.set_result(prefilled)

        def deliver(prefilled: PrefilledRequest) -> None:
            with contextlib.suppress(RuntimeError):  # the replica's loop is closing: nobody is waiting any more
                loop.call_soon_threadsafe(settle, prefilled)

        request_id = self.engine.submit(prompt, params, deliver)
        try:
            return await future
        except asyncio.CancelledError:  # the caller went away: its prompt need not run
            self.engine.cancel(request_id)
            raise

    async def _events(self, submit: Callable[[EventSink], Any],
                      first: Sequence[TokenEvent] = ()) -> AsyncIterator[TokenEvent]:
        """Submit through `submit(deliver)`, then yield `first` and the events the engine delivers."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[TokenEvent] = asyncio.Queue()

        def deliver(event: TokenEvent) -> None:
            try:
                loop.call_soon_threadsafe(queue.put_nowait, event)
            except RuntimeError:  # the replica's loop is closing: nobody is reading any more
                pass

        request_id = submit(deliver)
        finished = False
        try:
            for event in first:
                yield event
            while not finished:
                event = await queue.get()
                finished = event.token is None
                yield event
        finally:
            if not finished:
                self.engine.cancel(request_id)

    async def text(self, prompt: list[int], params: SamplingParams, stop: tuple[str, ...] = (),
                   events: AsyncIterator[TokenEvent] | None = None) -> AsyncIterator[str | TextOutput]:
        """Text deltas as they are decoded, cut at the first stop string; last, the whole TextOutput.

        The tokens are the request's own on this engine, or `events` (a disaggregated request's)."""
        decoder, scanner = self.codec.decoder(), StopScanner(stop)
        generated, finish_reason = 0, "length"
        events = self.tokens(prompt, params) if events is None else events
        async with contextlib.aclosing(events) as events:  # closing cancels the request
            async for event in events:
                if event.token is None:
                    finish_reason = event.finish_reason or "length"
                    break
                generated += 1
                if delta := scanner.push(decoder.push(event.token)):
                    yield delta
                if scanner.stopped:
                    break
        if tail := scanner.push(decoder.flush()) + scanner.flush():
            yield tail
        if scanner.stopped:
            finish_reason = "stop"
        yield TextOutput(scanner.text[:scanner.sent], len(prompt), generated, finish_reason)
