"""Find running baige-ray jobs on a Ray cluster and describe one: state, plan, workers, events, rates.

A job's ElasticController actor is named `baige-controller:<run name>` in the
"baige" namespace; its `status()` returns the dict `format_status` renders.
"""

from __future__ import annotations

import time
from collections import defaultdict
from typing import Any

CONTROLLER_NAMESPACE = "baige"
CONTROLLER_PREFIX = "baige-controller:"
STATUS_TIMEOUT_S = 30.0
# Event fields worth showing after the reason, in this order.
_EVENT_DETAILS = ("rank", "node_id", "step", "train_devices", "infer_devices", "num_workers", "layout")


def find_runs() -> list[str]:
    """Run names of every live controller on the connected cluster, sorted."""
    import ray

    names = ray.util.list_named_actors(all_namespaces=True)
    return sorted(entry["name"].removeprefix(CONTROLLER_PREFIX) for entry in names
                  if entry["namespace"] == CONTROLLER_NAMESPACE and entry["name"].startswith(CONTROLLER_PREFIX))


def choose_run(runs: list[str], name: str | None) -> str:
    """The run to show: `name`, or the only run when no name is given."""
    if name is not None:
        if name not in runs:
            raise ValueError(f"--name={name!r} is invalid: running jobs are {', '.join(runs) or 'none'}")
        return name
    if not runs:
        raise ValueError("no baige-ray job is running on this cluster (no baige-controller:* actor "
                         f"in namespace {CONTROLLER_NAMESPACE!r})")
    if len(runs) > 1:
        raise ValueError(f"{len(runs)} jobs are running ({', '.join(runs)}): choose one with --name")
    return runs[0]


def fetch_status(name: str | None = None, timeout_s: float = STATUS_TIMEOUT_S) -> dict[str, Any]:
    """`status()` of the named run's controller (or of the only run), from a connected driver."""
    import ray

    run = choose_run(find_runs(), name)
    controller = ray.get_actor(CONTROLLER_PREFIX + run, namespace=CONTROLLER_NAMESPACE)
    return ray.get(controller.status.remote(), timeout=timeout_s)


def format_status(status: dict[str, Any], *, num_events: int = 10) -> str:
    """A readable, multi-line summary of a controller's status dict."""
    lines = [_headline(status), _plan_line(status), _rate_line(status)]
    if status.get("recoveries"):
        lines.append(_recovery_line(status["recoveries"]))
        lines += _recovery_phase_lines(status["recoveries"][-1])
    if status.get("expert_load"):
        lines.append(_expert_line(status["expert_load"]))
    lines.append("workers per node:")
    lines += [f"  {row}" for row in _node_rows(status.get("workers", []))] or ["  (none)"]
    events = status.get("events", [])[-num_events:]
    lines.append(f"recent events ({len(events)} of {len(status.get('events', []))}):")
    lines += [f"  {format_event(event)}" for event in events] or ["  (none)"]
    return "\n".join(lines)


def _expert_line(load: list[list[int]]) -> str:
    """The last step's expert load: imbalance of the worst MoE layer and its per-expert slots."""
    from baige_ray.ops.expert_load import imbalance

    worst = max(load, key=lambda counts: imbalance([counts]))
    return (f"experts: imbalance {imbalance(load):.2f} (max/mean routed tokens, worst of {len(load)} MoE layers); "
            f"that layer's tokens per expert: {worst}")


def format_event(event: dict[str, Any]) -> str:
    clock = time.strftime("%H:%M:%S", time.localtime(event["time"])) if "time" in event else "--:--:--"
    details = " ".join(f"{key}={_short(event[key])}" for key in _EVENT_DETAILS if key in event)
    reason = event.get("reason", "")
    return f"{clock}  {event.get('kind', '?'):<18} {reason}" + (f"  [{details}]" if details else "")


def _headline(status: dict[str, Any]) -> str:
    step, num_steps = status.get("step", 0), status.get("num_steps", 0)
    percent = f" ({100.0 * step / num_steps:.0f}%)" if num_steps else ""
    return (f"job {status.get('name', '?')}: {status.get('state', 'unknown')}, step {step}/{num_steps}{percent}, "
            f"elapsed {format_duration(status.get('elapsed_s', 0.0))}")


def _plan_line(status: dict[str, Any]) -> str:
    spares, harvesting = status.get("num_spares", 0), status.get("num_harvest", 0)
    return (f"layout {status.get('layout', '?')} on {status.get('num_workers', 0)} workers"
            + (f", {harvesting} beside serving replicas" if harvesting else "")
            + (f" (+{spares} spare{'s' if spares != 1 else ''})" if spares else ""))


def _rate_line(status: dict[str, Any]) -> str:
    rate = float(status.get("steps_per_s") or 0.0)
    goodput = status.get("goodput")
    text = f"{rate:.3g} steps/s, goodput " + (f"{100.0 * goodput:.1f}%" if goodput is not None else "n/a")
    remaining = status.get("num_steps", 0) - status.get("step", 0)
    if rate > 0 and remaining > 0 and status.get("state") not in ("finished", "failed"):
        text += f", about {format_duration(remaining / rate)} to go"
    return text


def _recovery_line(recoveries: list[dict[str, Any]]) -> str:
    last = recoveries[-1]
    times = [r["recovery_s"] for r in recoveries if "recovery_s" in r]
    text = f"{len(recoveries)} recover{'ies' if len(recoveries) != 1 else 'y'}"
    if times:
        text += f", last took {format_duration(times[-1])} (worst {format_duration(max(times))})"
    if last.get("lost_steps"):
        text += f", {last['lost_steps']} step{'s' if last['lost_steps'] != 1 else ''} redone"
    return text


# The recovery's milestones, in order, as the controller records them (seconds since the failed step began).
RECOVERY_MILESTONES = (("detected", "detected"), ("decided", "decided"), ("regrouped", "regrouped"),
                       ("first_step_done", "next step done"))


def _recovery_phase_lines(last: dict[str, Any]) -> list[str]:
    """Where the last recovery's time went: its milestones, and the slowest member's seconds per part of
    the regroup (join, build_engine, fetch_state, load_state)."""
    phases, parts = last.get("phases_s") or {}, last.get("regroup_parts_s") or {}
    lines = []
    milestones = [f"{label} {phases[key]:.2f}s" for key, label in RECOVERY_MILESTONES if key in phases]
    if milestones:
        lines.append("  last recovery: " + ", ".join(milestones))
    if parts:
        lines.append("  its regroup, slowest member: " + ", ".join(f"{part} {seconds:.2f}s"
                                                                     for part, seconds in parts.items()))
    return lines


def _node_rows(workers: list[dict[str, Any]]) -> list[str]:
    by_node: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for worker in workers:
        by_node[str(worker.get("node_id"))].append(worker)
    rows = []
    for node_id, members in sorted(by_node.items(), key=lambda item: min(w["rank"] for w in item[1])):
        members.sort(key=lambda w: w["rank"])
        ip = members[0].get("node_ip") or "?"
        devices = ",".join(str(w.get("device_index", "?")) + ("(shared)" if w.get("share", 1.0) < 1 else "")
                           for w in members)
        rows.append(f"{ip} ({_short(node_id)}): {len(members)} worker{'s' if len(members) != 1 else ''}, "
                    f"ranks {compress_ranges([w['rank'] for w in members])}, devices {devices}")
    return rows


def compress_ranges(numbers: list[int]) -> str:
    """[0, 1, 2, 5, 7, 8] -> "0-2,5,7-8"."""
    parts: list[str] = []
    ordered = sorted(numbers)
    start = previous = None
    for number in ordered + [None]:
        if previous is not None and number == previous + 1:
            previous = number
            continue
        if start is not None:
            parts.append(str(start) if start == previous else f"{start}-{previous}")
        start = previous = number
    return ",".join(parts)


def format_duration(seconds: float) -> str:
    seconds = max(0.0, float(seconds))
    if seconds < 60:
        return f"{seconds:.1f}s"
    minutes, secs = divmod(int(round(seconds)), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m{secs:02d}s" if hours else f"{minutes}m{secs:02d}s"


def _short(value: Any) -> str:
    text = str(value)
    return text[:8] if len(text) > 16 and text.isalnum() else text  # Ray node ids are 56 hex characters
