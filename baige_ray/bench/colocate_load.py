"""The colocate benchmark's load: a compressed diurnal request rate, Poisson arrivals, an HTTP replayer.

Pure arithmetic (rates, arrivals) is separate from the replayer so it is unit-tested without a server.
"""

from __future__ import annotations

import asyncio
import math
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass

PROMPTS = ("def forward(self", "import numpy as ", "class Scheduler(", "for index, item ", "return self._cac")


def diurnal_rates(
    num_hours: int = 24, trough: float = 3.0, peak_ratio: float = 5.0, noise: float = 0.1, seed: int = 0
) -> list[float]:
    """Requests/s for each "hour": a cosine day from `trough` at midnight to peak_ratio x trough at noon,
    times independent noise in [1 - noise, 1 + noise] from a seeded RNG."""
    if num_hours < 1 or trough <= 0 or peak_ratio < 1 or not 0 <= noise < 1:
        raise ValueError(f"invalid diurnal load: num_hours={num_hours}, trough={trough}, "
                         f"peak_ratio={peak_ratio}, noise={noise}")
    rng = random.Random(seed)
    rates = []
    for hour in range(num_hours):
        phase = (1 - math.cos(2 * math.pi * (hour + 0.5) / num_hours)) / 2  # 0 at midnight, 1 at noon
        rates.append(trough * (1 + (peak_ratio - 1) * phase) * (1 + noise * rng.uniform(-1, 1)))
    return rates


def arrival_times(rates: Sequence[float], hour_s: float, seed: int = 0) -> list[float]:
    """Seconds from the start at which requests arrive: a Poisson process whose rate is rates[h]
    during hour h (each hour lasting hour_s seconds)."""
    if hour_s <= 0:
        raise ValueError(f"hour_s={hour_s} is invalid: expected > 0")
    rng = random.Random(seed)
    arrivals = []
    for hour, rate in enumerate(rates):
        start, end = hour * hour_s, (hour + 1) * hour_s
        at = start + rng.expovariate(rate)
        while at < end:
            arrivals.append(at)
            at += rng.expovariate(rate)
    return arrivals


@dataclass(frozen=True)
class RequestResult:
    sent_at: float  # seconds from the start of the replay
    latency_s: float | None  # None: failed
    status: int  # HTTP status, 0 for a connection error or timeout
    finished_at: float | None = None  # seconds from the start of the replay when the answer (or error) came
    reason: str = ""  # a failed request's answer (its first 200 characters) or the client's error


def request_body(index: int, max_new_tokens: int) -> dict:
    return {"prompt": PROMPTS[index % len(PROMPTS)], "max_new_tokens": max_new_tokens,
            "temperature": 0.8, "seed": index}


async def _send(session, url: str, index: int, started: float, max_new_tokens: int) -> RequestResult:
    import aiohttp

    sent = time.perf_counter()
    try:
        async with session.post(url, json=request_body(index, max_new_tokens)) as response:
            body = await response.read()
            status = response.status
    except (aiohttp.ClientError, asyncio.TimeoutError) as error:
        return RequestResult(sent - started, None, 0, time.perf_counter() - started, reason=repr(error)[:200])
    latency = time.perf_counter() - sent
    if status != 200:
        return RequestResult(sent - started, None, status, time.perf_counter() - started,
                             reason=body[:200].decode(errors="replace"))
    return RequestResult(sent - started, latency, status, time.perf_counter() - started)


async def _replay(url: str, arrivals: Sequence[float], max_new_tokens: int, timeout_s: float) -> list[RequestResult]:
    import aiohttp

    timeout = aiohttp.ClientTimeout(total=timeout_s)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=timeout) as session:
        started = time.perf_counter()
        tasks = []
        for index, at in enumerate(arrivals):
            delay = started + at - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(_send(session, url, index, started, max_new_tokens)))
        return list(await asyncio.gather(*tasks))


def replay(url: str, arrivals: Sequence[float], *, max_new_tokens: int = 16, timeout_s: float = 60.0) -> list[RequestResult]:
    """POST one generate request at each arrival time (open loop: a slow answer never delays the next)."""
    return asyncio.run(_replay(url, arrivals, max_new_tokens, timeout_s))


async def _saturate(url: str, seconds: float, concurrency: int, max_new_tokens: int) -> int:
    import aiohttp

    deadline = time.perf_counter() + seconds
    completed = 0

    async def client(session, offset: int) -> None:
        nonlocal completed
        index = offset
        while time.perf_counter() < deadline:
            async with session.post(url, json=request_body(index, max_new_tokens)) as response:
                await response.read()
                completed += response.status == 200
            index += concurrency

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
        await asyncio.gather(*(client(session, offset) for offset in range(concurrency)))
    return completed


def saturated_throughput(url: str, *, seconds: float = 6.0, concurrency: int = 16, max_new_tokens: int = 16) -> float:
    """Requests/s the application answers with `concurrency` requests always outstanding (closed loop)."""
    started = time.perf_counter()
    completed = asyncio.run(_saturate(url, seconds, concurrency, max_new_tokens))
    return completed / (time.perf_counter() - started)
