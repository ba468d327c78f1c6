"""Several requests of one HTTP request (a completions request with several prompts) run together: their
results gathered, or their streams merged as items arrive. A failure of one cancels the others, so no
request goes on in the engine for an answer nobody will read. Plain asyncio."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Sequence
from typing import Any, TypeVar

T = TypeVar("T")
_END = object()


async def gather_cancelling(awaitables: Sequence[Awaitable[T]]) -> list[T]:
    """Every awaitable's result, in order; the first failure cancels the rest (and is raised once they ended)."""
    tasks = [asyncio.ensure_future(awaitable) for awaitable in awaitables]
    try:
        return await asyncio.gather(*tasks)
    finally:
        for task in tasks:
            task.cancel()  # nothing for those already done
        await asyncio.gather(*tasks, return_exceptions=True)


async def _first(stream: AsyncIterator[T]) -> T:
    return await anext(stream)


async def first_items(streams: Sequence[AsyncIterator[T]]) -> list[T]:
    """Each stream's first item, awaited together (a request is submitted when its stream starts); when one
    raises, every stream is closed and that error raised."""
    results = await asyncio.gather(*(_first(stream) for stream in streams), return_exceptions=True)
    errors = [result for result in results if isinstance(result, BaseException)]
    if errors:
        for stream in streams:
            await stream.aclose()
        raise errors[0]
    return results


async def merged(firsts: Sequence[Any], streams: Sequence[AsyncIterator[Any]]) -> AsyncIterator[tuple[int, Any]]:
    """(index, item) of every stream, `firsts[index]` first, the others as they arrive; a stream's error is
    raised here, and closing this closes every stream."""
    queue: asyncio.Queue = asyncio.Queue()
    for index, first in enumerate(firsts):
        queue.put_nowait((index, first, None))

    async def pump(index: int, stream: AsyncIterator[Any]) -> None:
        try:
            async for item in stream:
                queue.put_nowait((index, item, None))
        except Exception as error:  # handed to the reader, which raises it
            queue.put_nowait((index, None, error))
        queue.put_nowait((index, _END, None))

    tasks = [asyncio.create_task(pump(index, stream)) for index, stream in enumerate(streams)]
    try:
        remaining = len(streams)
        while remaining:
            index, item, error = await queue.get()
            if error is not None:
                raise error
            if item is _END:
                remaining -= 1
                continue
            yield index, item
    finally:
        for task in tasks:
            task.cancel()  # a pump's stream closes as its cancellation unwinds it
        await asyncio.gather(*tasks, return_exceptions=True)
