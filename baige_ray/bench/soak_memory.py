"""How much each long-lived process's resident memory grew over a soak (pure: from the samples taken).

A sample is (seconds since the start, {pid: (actor class, resident bytes)}, the job's worker pids then).
A process's growth counts from the first sample of the window at which it had settled: alive for
`SETTLE_S` already (a controller Ray restarted is still importing and warming up before that) and, for a
worker, a member of the job one sample since (a warm spare loads the model when it joins: not a leak).
"""

from __future__ import annotations

from typing import Any

SETTLE_S = 60.0
WORKER_CLASS = "ElasticWorkerActor"

Sample = tuple[float, dict[int, tuple[str, int]], set[int]]


def memory_growth(samples: list[Sample], from_s: float) -> dict[str, Any]:
    """Per process alive from `from_s` to the end: its resident memory's relative growth from when it settled,
    keyed "class:pid"; and the window the samples cover."""
    first = next((i for i, sample in enumerate(samples) if sample[0] >= from_s), len(samples) - 1)
    last_rss = samples[-1][1]
    grown = {}
    for pid, (name, _) in samples[first][1].items():
        settled = next((rss[pid][1] for i, (_, rss, _) in enumerate(samples[first:], first)
                        if pid in rss and _settled(samples, pid, i, worker=name == WORKER_CLASS)), None)
        if settled and pid in last_rss:
            grown[f"{name}:{pid}"] = (last_rss[pid][1] - settled) / settled
    return {"from_s": round(samples[first][0], 1), "to_s": round(samples[-1][0], 1), "growth": grown,
            "timeline_mib": timeline(samples, [int(key.rsplit(":", 1)[1]) for key in grown])}


def timeline(samples: list[Sample], pids: list[int], every_s: float = 60.0) -> dict[str, list[float]]:
    """Each of `pids`' resident memory in MiB about every `every_s` seconds, "class:pid" -> values (None
    where the process was not alive), so a growth shows whether it levels off or keeps climbing."""
    picked, next_at = [], 0.0
    for sample in samples:
        if sample[0] >= next_at:
            picked.append(sample)
            next_at = sample[0] + every_s
    if samples and picked[-1] is not samples[-1]:
        picked.append(samples[-1])
    out = {}
    for pid in pids:
        name = next(rss[pid][0] for _, rss, _ in samples if pid in rss)
        out[f"{name}:{pid}"] = [round(rss[pid][1] / (1 << 20), 1) if pid in rss else None for _, rss, _ in picked]
    return out


def _settled(samples: list[Sample], pid: int, index: int, *, worker: bool) -> bool:
    at = samples[index][0]
    alive = all(pid in rss for seconds, rss, _ in samples[:index + 1] if seconds >= at - SETTLE_S)
    return alive and (not worker or (pid in samples[index][2] and pid in samples[max(0, index - 1)][2]))
