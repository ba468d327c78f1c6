"""Output tokens/s over HTTP of servers that are up side by side, measured in rounds by vLLM's benchmark client.

On a machine of few cores one run of a server against one run of its peer an hour apart says little (`vllm
serve` alone gave 824 to 2,983 tokens/s at 32 streams in runs of one morning here). So every server stays up
while the others are measured (idle, they take next to no CPU), each round measures each of them once at each
concurrency, and the order of the servers reverses from one round to the next. A ratio is the geometric
mean over the rounds of the round's ratio.
"""

from __future__ import annotations

import math
from typing import Any, Protocol

PEER = "vllm serve"


class Client(Protocol):
    prompts: int

    def run(self, url: str, name: str, backend: str, prompts: int, streams: int | None) -> dict: ...


def measure_rounds(client: Client, servers: dict[str, str], streams: tuple[int, ...], rounds: int) -> dict[str, dict]:
    """{server: {streams: [each round's result]}} for `servers` (name -> base URL), the openai backend, the
    client's prompts per two streams at each concurrency."""
    results: dict[str, dict] = {name: {count: [] for count in streams} for name in servers}
    names = list(servers)
    for index in range(rounds):
        order = names if index % 2 == 0 else names[::-1]
        for count in streams:
            for name in order:
                label = f"{_slug(name)}-{count}-round{index}"
                results[name][count].append(client.run(servers[name], label, "openai",
                                                       client.prompts * max(1, count // 2), count))
    return results


def ratio_by_streams(results: dict[str, dict], server: str) -> dict[int, float]:
    """`server`'s output tokens/s over the peer's at each concurrency: the geometric mean of the rounds' ratios
    (rounds where either run failed are left out)."""
    ratios = {}
    for count, ours in results[server].items():
        pairs = [(mine.get("output_tokens_per_s"), theirs.get("output_tokens_per_s"))
                 for mine, theirs in zip(ours, results[PEER][count])]
        logs = [math.log(mine / theirs) for mine, theirs in pairs if mine and theirs]
        if logs:
            ratios[count] = math.exp(sum(logs) / len(logs))
    return ratios


def headline(ratios: dict[int, float]) -> float | None:
    """The lower ratio of 8 and 32 streams, where measured."""
    measured = [ratios[count] for count in (8, 32) if count in ratios]
    return min(measured) if measured else None


def figures(results: dict[str, dict]) -> dict[str, Any]:
    """Each server's tokens/s and TTFT p50 per concurrency, round by round, for the JSON result."""
    return {name: {str(count): {"output_tokens_per_s": [_rounded(run.get("output_tokens_per_s")) for run in runs],
                                "ttft_p50_ms": [_rounded(run.get("ttft_p50_ms")) for run in runs],
                                "completed": [run.get("completed") for run in runs]}
                   for count, runs in by_count.items()}
            for name, by_count in results.items()}


def _rounded(value: float | None) -> float | None:
    return None if value is None else round(value, 1)


def _slug(name: str) -> str:
    return "".join(c if c.isalnum() else "-" for c in name).strip("-")
