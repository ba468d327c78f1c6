"""The continuous-batching engine on its own thread, fed and read from a replica's asyncio loop.

Forward passes run on the engine's thread, so the event loop keeps accepting requests, streaming
tokens and answering health checks while the batch computes. Each request gets an asyncio queue
that the engine's thread fills with its `TokenEvent`s; a request whose reader goes away (the
client disconnected) is cancelled and leaves the batch at the next step.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import AsyncIterator

from baige_ray.serving.causal_lm_generation import SamplingParams, fit_prompt
from baige_ray.serving.engine import ContinuousBatchingEngine, EngineLimits, TokenEvent
from baige_ray.serving.generators import TextGenerator, TextOutput
from baige_ray.serving.openai_api import StopScanner

IDLE_WAIT_S = 0.05


class EngineRunner:
    def __init__(self, generator: TextGenerator, limits: EngineLimits):
        self.generator = generator
        self.engine = ContinuousBatchingEngine(generator.decoder, eos_token_id=generator.codec.eos_token_id,
                                               limits=limits)
        self.busy_s = 0.0  # time spent stepping, read and reset by the replica's load reports
        self._stop = threading.Event()
        self._retiring = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="baige-engine", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.is_set():
            started = time.perf_counter()
            if self.engine.step():
                self.busy_s += time.perf_counter() - started
            elif self._retiring.is_set():
                return
            else:
                self.engine.wait_for_work(IDLE_WAIT_S)

    def retire(self) -> None:
        """Finish what was submitted (on these weights), then stop the thread."""
        self._retiring.set()

    def stop(self) -> None:
        self._stop.set()

    async def tokens(self, prompt: list[int], params: SamplingParams) -> AsyncIterator[TokenEvent]:
        """The request's events as they are sampled; raises EngineFull when the queue is full."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[TokenEvent] = asyncio.Queue()

        def deliver(event: TokenEvent) -> None:
            try:
                loop.call_soon_threadsafe(queue.put_nowait, event)
            except RuntimeError:  # the replica's loop is closing: nobody is reading any more
                pass

        request_id = self.engine.submit(prompt, params, deliver)
        finished = False
        try:
            while not finished:
                event = await queue.get()
                finished = event.token is None
                yield event
        finally:
            if not finished:
                self.engine.cancel(request_id)

    async def text(self, prompt: list[int], params: SamplingParams,
                   stop: tuple[str, ...] = ()) -> AsyncIterator[str | TextOutput]:
        """Text deltas as they are decoded, cut at the first stop string; last, the whole TextOutput."""
        decoder, scanner = self.generator.codec.decoder(), StopScanner(stop)
        generated, finish_reason = 0, "length"
        async with contextlib.aclosing(self.tokens(prompt, params)) as events:  # closing cancels the request
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
        used = fit_prompt(prompt, params.max_new_tokens, self.generator.decoder.max_context)
        yield TextOutput(scanner.text[:scanner.sent], len(used), generated, finish_reason)
