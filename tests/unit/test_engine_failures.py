"""An engine that raises fails every request it holds, and every later one, at once with its reason;
the runner then reports itself failed (the replica's health check). No Ray: the real continuous-batching
engine and runner around the reference GPT whose decoder raises on a poisoned prompt's cue
(tests/serving_faults.py)."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
import torch

from baige_ray.models.gpt import GPT
from baige_ray.models.gpt_decoding import ByteCodec
from baige_ray.serving.causal_lm_generation import SamplingParams
from baige_ray.serving.engine import ContinuousBatchingEngine, EngineLimits
from baige_ray.serving.engine_runner import EngineFailed, EngineRunner
from baige_ray.serving.prefill import PrefillEngine
from tests.serving_faults import FAULT_MESSAGE, POISON, FaultyGPTConfig, FaultyGPTDecoder

PROMPT_FAILS_WITHIN_S = 2.0


def faulty_decoder(**fault) -> FaultyGPTDecoder:
    config = FaultyGPTConfig(seq_len=128, num_layers=1, num_heads=2, hidden=32, **fault)
    torch.manual_seed(0)
    return FaultyGPTDecoder(GPT(config), config)


def runner_of(decoder: FaultyGPTDecoder, max_batch_size: int = 2) -> EngineRunner:
    engine = ContinuousBatchingEngine(decoder, eos_token_id=None,
                                      limits=EngineLimits(max_batch_size=max_batch_size, max_waiting=8))
    return EngineRunner(engine, ByteCodec())


def greedy(max_new_tokens: int) -> SamplingParams:
    return SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0)


async def collect(events) -> tuple[int, BaseException | None, float]:
    """(tokens received, the error that ended the request or None, when it ended)."""
    received = 0
    try:
        async for event in events:
            received += event.token is not None
    except EngineFailed as error:
        return received, error, time.perf_counter()
    return received, None, time.perf_counter()


async def hold_engine(runner: EngineRunner) -> tuple[threading.Event, asyncio.Task]:
    """Block the engine's thread between two steps until the returned event is set."""
    held, release = threading.Event(), threading.Event()

    def hold() -> None:
        held.set()
        release.wait(10)

    task = asyncio.create_task(runner.between_steps(hold))
    assert await asyncio.to_thread(held.wait, 10)
    return release, task


def test_an_engine_that_raises_fails_its_running_and_waiting_requests_with_the_reason():
    decoder = faulty_decoder(fail_after=2)  # the poisoned prefill and one decode run, the next decode raises
    runner = runner_of(decoder, max_batch_size=2)
    failures: list[str] = []
    runner.after_failure(failures.append)

    async def scenario():
        running = runner.tokens(ByteCodec().encode("def parse("), greedy(100))
        assert (await anext(running)).token is not None  # in the batch, decoding
        release, held = await hold_engine(runner)  # the next two arrive together, while A decodes
        poisoned = asyncio.create_task(collect(runner.tokens(ByteCodec().encode(POISON + "x"), greedy(100))))
        waiting = asyncio.create_task(collect(runner.tokens(ByteCodec().encode("import"), greedy(5))))
        await asyncio.sleep(0.05)
        assert runner.engine.num_waiting == 2 and runner.engine.num_running == 1
        released = time.perf_counter()
        release.set()
        await held
        results = [await collect(running), await poisoned, await waiting]
        return released, results

    released, results = asyncio.run(scenario())
    (running_tokens, *_), (poisoned_tokens, *_), (waiting_tokens, *_) = results
    assert (poisoned_tokens, waiting_tokens) == (2, 0)  # the batch held A and P; W was still queued
    assert running_tokens >= 1
    for _, error, ended in results:
        assert isinstance(error, EngineFailed) and error.accepted
        assert FAULT_MESSAGE in str(error) and str(error).startswith("the replica's engine failed: FaultInjected")
        assert ended - released < PROMPT_FAILS_WITHIN_S
    assert decoder.num_faults == 1
    runner.join()  # the failure ended the engine's thread, after telling the requests and the hooks
    assert len(failures) == 1 and FAULT_MESSAGE in failures[0] and runner.failure == failures[0]


def test_a_failed_runner_reports_unhealthy_and_refuses_new_work_at_once():
    runner = runner_of(faulty_decoder(fail_after=0))  # the poisoned prompt's prefill raises
    runner.check()  # healthy

    async def scenario():
        poisoned = await collect(runner.tokens(ByteCodec().encode(POISON), greedy(4)))
        with pytest.raises(EngineFailed) as refused:
            await anext(runner.tokens(ByteCodec().encode("import"), greedy(4)))
        with pytest.raises(EngineFailed):
            await runner.between_steps(lambda: None)
        return poisoned, refused.value

    (tokens, error, _), refused = asyncio.run(scenario())
    assert tokens == 0 and isinstance(error, EngineFailed)
    assert not refused.accepted and FAULT_MESSAGE in refused.reason
    with pytest.raises(EngineFailed, match=FAULT_MESSAGE):
        runner.check()
    late: list[str] = []
    runner.after_failure(late.append)  # a hook added after the failure runs at once
    assert late == [runner.failure]


def test_text_streams_what_was_decoded_then_raises():
    runner = runner_of(faulty_decoder(fail_after=3))

    async def scenario():
        pieces = []
        with pytest.raises(EngineFailed, match=FAULT_MESSAGE):
            async for piece in runner.text(ByteCodec().encode(POISON + "ab"), greedy(50)):
                pieces.append(piece)
        return pieces

    assert len(asyncio.run(scenario())) <= 3  # three tokens were sampled, none of them the end


def test_a_prefill_waiting_for_a_failed_engine_fails():
    config = FaultyGPTConfig(seq_len=64, num_layers=1, num_heads=2, hidden=32)
    torch.manual_seed(0)
    engine = PrefillEngine(FaultyGPTDecoder(GPT(config), config), eos_token_id=None, limits=EngineLimits())
    runner = EngineRunner(engine, ByteCodec())

    async def scenario():
        with pytest.raises(EngineFailed, match=FAULT_MESSAGE):
            await asyncio.wait_for(runner.prefill(ByteCodec().encode(POISON), greedy(4)), PROMPT_FAILS_WITHIN_S)

    asyncio.run(scenario())


def test_a_healthy_runner_stays_healthy_after_serving_and_retiring():
    runner = runner_of(faulty_decoder(fail_after=0))

    async def scenario():
        return await collect(runner.tokens(ByteCodec().encode("import"), greedy(6)))

    assert asyncio.run(scenario())[:2] == (6, None)
    runner.check()
    runner.retire()
    runner.join()
    runner.check()  # retired on purpose: not a failure
