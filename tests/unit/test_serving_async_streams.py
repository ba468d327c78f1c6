"""The requests of one HTTP request run together: gathered, or their streams merged; a failure of one
cancels the others and every stream is closed (its engine request cancelled)."""

from __future__ import annotations

import asyncio

import pytest

from baige_ray.serving.async_streams import first_items, gather_cancelling, merged


class Stream:
    """An async generator of `items` with `delay` s between them, recording whether it was closed early."""

    def __init__(self, items, delay: float = 0.0, fail_after: int | None = None):
        self.items, self.delay, self.fail_after, self.closed, self.finished = items, delay, fail_after, False, False

    async def __call__(self):
        try:
            for number, item in enumerate(self.items):
                if number == self.fail_after:
                    raise RuntimeError(f"failed after {number}")
                await asyncio.sleep(self.delay)
                yield item
            self.finished = True
        finally:
            self.closed = not self.finished


async def drain(pieces) -> list:
    return [piece async for piece in pieces]


def test_merged_streams_keep_each_streams_order_and_give_every_item():
    async def run():
        makers = [Stream(["a1", "a2", "a3"], 0.003), Stream(["b1", "b2"], 0.001)]
        streams = [maker() for maker in makers]
        firsts = await first_items(streams)
        return firsts, await drain(merged(firsts, streams))

    firsts, pieces = asyncio.run(run())
    assert firsts == ["a1", "b1"]
    assert [item for index, item in pieces if index == 0] == ["a1", "a2", "a3"]
    assert [item for index, item in pieces if index == 1] == ["b1", "b2"]


def test_a_failing_stream_fails_the_merge_and_cancels_the_others():
    makers = [Stream(["a"] * 50, 0.01), Stream(["b1", "b2", "b3"], 0.001, fail_after=2)]

    async def run():
        streams = [maker() for maker in makers]
        await drain(merged(await first_items(streams), streams))

    with pytest.raises(RuntimeError, match="failed after 2"):
        asyncio.run(run())
    assert makers[0].closed


def test_closing_the_merge_closes_every_stream():
    makers = [Stream(["a"] * 50, 0.01), Stream(["b"] * 50, 0.01)]

    async def run():
        streams = [maker() for maker in makers]
        pieces = merged(await first_items(streams), streams)
        assert [await anext(pieces) for _ in range(3)]
        await pieces.aclose()

    asyncio.run(run())
    assert all(maker.closed for maker in makers)


def test_a_stream_failing_to_start_closes_the_others():
    makers = [Stream(["a"] * 5), Stream(["b"], fail_after=0)]

    async def run():
        await first_items([maker() for maker in makers])

    with pytest.raises(RuntimeError, match="failed after 0"):
        asyncio.run(run())
    assert makers[0].closed


def test_gather_cancelling_returns_in_order_or_cancels_the_rest_on_a_failure():
    cancelled = []

    async def value(result, delay):
        await asyncio.sleep(delay)
        return result

    async def slow():
        try:
            await asyncio.sleep(5)
        except asyncio.CancelledError:
            cancelled.append(True)
            raise

    async def failing():
        await asyncio.sleep(0.01)
        raise ValueError("full")

    assert asyncio.run(gather_cancelling([value(1, 0.02), value(2, 0.0)])) == [1, 2]
    with pytest.raises(ValueError, match="full"):
        asyncio.run(gather_cancelling([slow(), failing()]))
    assert cancelled == [True]
