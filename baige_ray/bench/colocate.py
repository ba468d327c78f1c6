"""Train and serve on one 8-device pool: the PoolArbiter against a static half/half split.

A training job (the reference GPT, elastic between `--min-train` and 8 ranks) and a Serve
application of the same model share the simulated 2-node x 4-GPU cluster. The same compressed
diurnal load is replayed twice over HTTP in one run: 24 "hours" of `--hour-s` seconds, from the
trough to 5x the trough and back, with Poisson arrivals and seeded noise. The load is scaled to
what one replica serves: before the replays, one replica is driven to saturation (closed loop)
while training runs, and the trough is set so that the peak is `--peak-replicas` times that
throughput.

- `dynamic` (top-level keys): training holds 5 whole devices and serving keeps `--min-infer` 3
  replicas warm, each on 3/4 of a device (`--harvest-share` 0.25 left free). The PoolArbiter
  harvests lightly loaded replicas' devices: each gets one training rank beside its replica. As
  load rises, it gives those devices back first; each give-back is a training regroup of about half
  a second. Only once none is shared does it lend whole devices, which starts a replica. Training
  workers run at `--train-niceness` 10, so on this CPU box the replicas and the proxy take the
  shared cores first, as they would have devices of their own.
- `static`: training holds 4 devices and serving 4, for the whole day. No harvesting; the
  niceness is the same.

Why these defaults (measured on the 2-core CI box shared with other work):
- `--hour-s 12` (about 5 minutes a day, 12-13 minutes for the whole bench):
  - A lend takes 12-35 s here, mostly a new replica process importing torch on shared cores. A
    reclaim or a harvest takes 11-25 s, mostly a new training worker starting; training runs meanwhile.
  - With 4 s hours that is 3-9 simulated hours.
  - At 12 s hours a change costs 1-3 hours, which the forecast (the trend of the last 3 hours,
    one measured lend latency ahead) covers.
- `--peak-replicas 0.8`:
  - One replica flat out serves the peak only with queueing far past the objective (p99 1.2-2.8 s
    measured at 1.0x).
  - Higher peaks measure the box, not the pool: with one HTTP proxy and every process on 2
    shared cores, the whole serving path saturated at 1.3-1.9x one replica's throughput,
    whatever the split.
- Three warm replicas, not fewer:
  - With two, the peak needed a lend. Each such lend's replica start, CPU-heavy on shared cores,
    coincided with the breaches: attainment was 0.90 and 0.96 in two runs, breached in hours 10-12.
  - With three, the peak is met by giving back a shared device, a regroup, and the day needs no
    lend at all.
- The policy keeps replicas below about 47% of their saturated throughput: lend above 0.47, size
  to 0.46, harvest at or below 0.35 with a shared device counted as half a replica. The calibration
  is one moment of a box whose load average swings widely. Breaches while the replicas are below
  20% of capacity are stalls, not shortages.

Utilization is busy device-seconds over 8 x wall seconds, and a device counts once, whoever keeps it
busy (see colocate_accounting.py):
- Training's devices, whole or shared, are busy while the job is running. The state is sampled
  4 times a second; pauses to regroup or recover count as idle.
- A replica's device is busy while the replica computes a batch (the seconds replicas report), unless
  a running harvest rank already keeps that device busy.

SLO attainment is the fraction of requests answered within `--slo-p99-s`, measured client-side;
failed requests count as misses. A failed request is any non-200 answer or a connection error.
"""

from __future__ import annotations

import argparse
import math
import time
from collections.abc import Sequence
from typing import Any

from baige_ray.bench.colocate_accounting import PoolSampler, infer_device_seconds, train_device_seconds
from baige_ray.bench.measure import free_port

POOL_DEVICES = 8
MAX_TRAIN_DEVICES = 7  # whole devices: serving always keeps at least one
STATIC_SPLIT = 4
GLOBAL_BATCH = 84  # splits evenly over 3, 4, 6 and 7 data-parallel workers
PEAK_RATIO = 5.0
SEQ_LEN = 64  # the served GPT's context: a prompt (colocate_load.PROMPTS) and its new tokens must fit it


def slo_attainment(latencies: Sequence[float | None], slo_s: float) -> float:
    """Fraction of requests answered within the objective; a failed request (None) is a miss."""
    if not latencies:
        return 1.0
    return sum(1 for latency in latencies if latency is not None and latency <= slo_s) / len(latencies)


def hourly_attainment(sent_at: Sequence[float], latencies: Sequence[float | None], hour_s: float,
                      slo_s: float, num_hours: int = 24) -> list[float]:
    """SLO attainment of the requests sent in each simulated hour (1.0 for an hour without requests)."""
    by_hour: list[list[float | None]] = [[] for _ in range(num_hours)]
    for at, latency in zip(sent_at, latencies):
        by_hour[min(num_hours - 1, int(at // hour_s))].append(latency)
    return [round(slo_attainment(hour, slo_s), 3) for hour in by_hour]


def whole_device_bound(rates: Sequence[float], replica_capacity: float, busy_cap: float, *,
                       num_devices: int = POOL_DEVICES, min_infer: int = 1, min_train: int = 3) -> float:
    """The utilization no whole-device lending can beat on this day: each hour's replicas are the fewest
    that keep each at or below `busy_cap` of its saturated throughput (at least `min_infer`), moves are
    free and instant, training keeps every other device busy, and a replica is busy `rate / capacity`
    of the time (optimistic: small batches cost more per request than saturated ones)."""
    if replica_capacity <= 0 or not 0 < busy_cap <= 1:
        raise ValueError(f"replica_capacity={replica_capacity}, busy_cap={busy_cap}: expected > 0 and in (0, 1]")
    busy = 0.0
    for rate in rates:
        replicas = min(num_devices - min_train, max(min_infer, math.ceil(rate / (replica_capacity * busy_cap))))
        busy += (num_devices - replicas) + min(replicas, rate / replica_capacity)
    return busy / (num_devices * len(rates))


def phase_summary(*, train_busy_s: float, infer_busy_s: float, wall_s: float, latencies: Sequence[float | None],
                  slo_s: float, train_steps: int, num_devices: int = POOL_DEVICES) -> dict[str, Any]:
    from baige_ray.serving.ledger import percentile

    answered = [latency for latency in latencies if latency is not None]
    return {
        "utilization": round((train_busy_s + infer_busy_s) / (num_devices * wall_s), 4),
        "slo_attainment": round(slo_attainment(latencies, slo_s), 4),
        "failed_requests": len(latencies) - len(answered),
        "train_steps": train_steps,
        "requests": len(latencies),
        "p99_latency_s": round(percentile(answered, 0.99), 4) if answered else None,
        "train_device_s": round(train_busy_s, 1),
        "infer_busy_device_s": round(infer_busy_s, 1),
        "wall_s": round(wall_s, 1),
    }


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--hour-s", type=float, default=12.0, help="seconds per simulated hour (24 of them)")
    parser.add_argument("--trough", type=float, default=None,
                        help="requests/s at the trough (the peak is 5x); default: from --peak-replicas")
    parser.add_argument("--peak-replicas", type=float, default=0.8,
                        help="the peak load in multiples of one replica's measured saturated throughput")
    parser.add_argument("--slo-p99-s", type=float, default=1.0, help="p99 latency objective in seconds")
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--min-train", type=int, default=3, help="fewest devices training keeps")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--busy-cap", type=float, default=0.47,
                        help="the lending policy keeps each replica at most this busy (lends above it)")
    parser.add_argument("--capacity-from", choices=("calibration", "reports"), default="calibration",
                        help="a replica's capacity: the saturated throughput measured before the replays, or "
                             "refined online from the requests replicas serve per busy second")
    parser.add_argument("--min-infer", type=int, default=3,
                        help="replicas serving keeps up all day (the lending phase starts with this many)")
    parser.add_argument("--harvest-share", type=float, default=0.25,
                        help="fraction of a lightly loaded replica's device a training rank may use (0: no harvesting)")
    parser.add_argument("--harvest-below", type=float, default=0.35,
                        help="harvest while serving utilization, a shared device counting --shared-capacity, "
                             "stays at or below this")
    parser.add_argument("--train-niceness", type=int, default=10,
                        help="added to the OS niceness of the training workers: serving takes the shared cores first, as it "
                             "would its own devices (0: equal shares)")
    parser.add_argument("--engine", choices=("builtin", "vllm"), default="builtin",
                        help="the replicas' engine; with vllm the model is 128 wide (vLLM's CPU attention wants "
                             "heads of 32 and up) and runs as GPT-2 (models/gpt_hf.py)")
    parser.add_argument("--shared-capacity", type=float, default=0.5,
                        help="what a replica serves beside a training rank, as a fraction of its capacity")


def _run_phase(job, info, arrivals: list[float], args: argparse.Namespace) -> dict[str, Any]:
    from baige_ray.bench.colocate_load import replay

    with PoolSampler(job, info) as sampler:
        started = time.monotonic()
        results = replay(info.url + "/generate", arrivals, max_new_tokens=args.max_new_tokens)
        ended = time.monotonic()
        time.sleep(1.5)  # replicas report their busy seconds twice a second
    samples = sampler.samples
    hourly = hourly_attainment([r.sent_at for r in results], [r.latency_s for r in results], args.hour_s,
                               args.slo_p99_s)
    return {"hourly_slo_attainment": hourly, "started_at": time.time() - (time.monotonic() - started)} | phase_summary(
        train_busy_s=train_device_seconds(samples, started, ended),
        infer_busy_s=infer_device_seconds(samples),
        wall_s=ended - started,
        latencies=[r.latency_s for r in results],
        slo_s=args.slo_p99_s,
        train_steps=samples[-1].step - samples[0].step,
    ) | {"harvested_device_s": round(sum(
        len(a.shared) * (b.at - a.at) for a, b in zip(samples, samples[1:]) if a.training), 1)}


def _split(job, info, train_devices: int) -> None:
    """Move the pool to `train_devices` for training and the rest for serving, never over-committing."""
    from baige_ray.serving import scale_replicas

    if job.status()["num_workers"] - job.status().get("num_harvest", 0) > train_devices:
        job.resize(train_devices, reason="colocate static split")
        scale_replicas(info, POOL_DEVICES - train_devices)
    else:
        scale_replicas(info, POOL_DEVICES - train_devices)
        job.resize(train_devices, reason="colocate static split")


def _start(args: argparse.Namespace):
    import baige_ray as br
    from baige_ray.api.elastic import ElasticConfig
    from baige_ray.jobs.launch import launch
    from baige_ray.serving import serve

    model = br.GPTConfig(seq_len=SEQ_LEN, num_layers=2, num_heads=4, hidden=128 if args.engine == "vllm" else 64)
    job = launch(model, train=br.TrainConfig(num_steps=10**7, global_batch_size=GLOBAL_BATCH, warmup_steps=5),
                 scaling=br.ScalingConfig(num_workers=MAX_TRAIN_DEVICES, cpu_niceness=args.train_niceness),
                 run=br.RunConfig(name="colocate"),
                 elastic=ElasticConfig(min_workers=args.min_train, max_workers=_max_ranks(args)))
    while (status := job.status())["state"] != "running" or status["step"] < 2:
        if status["state"] in ("failed", "finished"):
            raise RuntimeError(f"the training job ended before serving started: {status['state']}")
        time.sleep(0.5)
    info = serve(job.latest_model_state(), model_config=model, name="colocate", port=free_port(),
                 max_ongoing_requests=64, max_queued_requests=4096, device_share=1 - args.harvest_share,
                 engine=args.engine)
    return model, job, info


def _max_ranks(args: argparse.Namespace) -> int:
    """Whole devices plus harvest ranks: with harvesting, training may run a rank on every device."""
    return POOL_DEVICES if args.harvest_share > 0 else MAX_TRAIN_DEVICES


def _arbiter_config(args: argparse.Namespace, capacity: float):
    from baige_ray.actors.arbiter import ArbiterConfig
    from baige_ray.api.configs import TrainConfig
    from baige_ray.elastic.sizing import valid_sizes
    from baige_ray.engines.train_job import TrainJob
    from baige_ray.models.gpt import GPTConfig
    from baige_ray.parallel.layout import ParallelLayout
    from baige_ray.policies.lending import LendingPolicy

    job = TrainJob(model=GPTConfig(), train=TrainConfig(num_steps=1, global_batch_size=GLOBAL_BATCH))
    sizes = valid_sizes(job, ParallelLayout(dp=MAX_TRAIN_DEVICES), args.min_train, _max_ranks(args))
    # Capacity is the saturated throughput; see the module docstring for the thresholds.
    change_s = max(10.0, args.hour_s)
    policy = LendingPolicy(lend_above=args.busy_cap, target_utilization=args.busy_cap - 0.01,
                           reclaim_below=min(0.3, args.busy_cap / 2), cooldown_s=change_s,
                           breach_cooldown_s=change_s, breach_min_utilization=0.2,
                           harvest_below=args.harvest_below if args.harvest_share > 0 else None)
    return ArbiterConfig(slo_p99_s=args.slo_p99_s, replica_capacity=capacity,
                         capacity_from_reports=args.capacity_from == "reports",
                         min_train_devices=args.min_train, min_infer_devices=args.min_infer, train_sizes=sizes,
                         poll_interval_s=1.0, load_window_s=4.0, lend_latency_s=15.0, trend_window_s=3 * args.hour_s,
                         policy=policy, harvest_share=args.harvest_share or None, shared_capacity=args.shared_capacity)


def _check_new_tokens(max_new_tokens: int) -> None:
    from baige_ray.bench.colocate_load import PROMPTS

    room = SEQ_LEN - max(len(prompt.encode()) for prompt in PROMPTS)
    if not 1 <= max_new_tokens <= room:  # a request that does not fit the context is a 400, not cut
        raise ValueError(f"--max-new-tokens={max_new_tokens} is invalid: expected 1 to {room}, so that the "
                         f"prompts and the new tokens fit the served model's context of {SEQ_LEN}")


def run(args: argparse.Namespace) -> dict[str, Any]:
    import dataclasses
    import os

    import ray

    import baige_ray as br
    from baige_ray.actors.arbiter import start_pool_arbiter
    from baige_ray.bench.colocate_load import arrival_times, diurnal_rates, saturated_throughput
    from baige_ray.serving import shutdown

    _check_new_tokens(args.max_new_tokens)
    load_before = os.getloadavg()
    with br.open_cluster("sim-2x4"):
        model, job, info = _start(args)
        capacity = saturated_throughput(info.url + "/generate", max_new_tokens=args.max_new_tokens)
        trough = args.trough or args.peak_replicas * capacity / PEAK_RATIO
        rates = diurnal_rates(trough=trough, peak_ratio=PEAK_RATIO, seed=args.seed)
        arrivals = arrival_times(rates, args.hour_s, seed=args.seed)
        _split(job, info, POOL_DEVICES - args.min_infer)
        time.sleep(5.0)  # let the calibration burst leave the load window
        config = _arbiter_config(args, capacity)
        arbiter = start_pool_arbiter("colocate", info, dataclasses.asdict(model), config)
        dynamic = _run_phase(job, info, arrivals, args)
        arbiter_status = ray.get(arbiter.stop.remote())
        if args.harvest_share > 0:
            job.harvest(0, share=args.harvest_share, reason="colocate static split")
        _split(job, info, STATIC_SPLIT)
        static = _run_phase(job, info, arrivals, args)
        job.stop()
        shutdown(info)
    moves = [e for e in arbiter_status["events"] if e["kind"] in ("lend", "reclaim", "harvest", "unharvest")]
    dynamic_start = dynamic.pop("started_at")
    static.pop("started_at")
    return {**dynamic, "lends": sum(e["kind"] == "lend" for e in moves),
            "reclaims": sum(e["kind"] == "reclaim" for e in moves),
            "harvests": sum(e["kind"] == "harvest" for e in moves),
            "unharvests": sum(e["kind"] == "unharvest" for e in moves),
            "moves": [[round(e["time"] - e["took_s"] - dynamic_start, 1), e["kind"], e["train_devices"],
                       e["infer_devices"], e["took_s"], e["request_rate"], e.get("forecast_rate"),
                       e.get("harvested_devices", 0)] for e in moves],
            "lend_latency_s": round(arbiter_status["lend_latency_s"], 1),
            "arbiter_errors": arbiter_status["errors"], "replica_capacity": round(capacity, 2),
            "trough_rate": round(trough, 2), "slo_p99_s": args.slo_p99_s, "hour_s": args.hour_s,
            "engine": args.engine,
            "utilization_bound": {str(cap): round(whole_device_bound(rates, capacity, cap, min_train=args.min_train), 4)
                                  for cap in (config.policy.lend_above, 1.0)},
            "load_average": {"before": [round(x, 2) for x in load_before],
                             "after": [round(x, 2) for x in os.getloadavg()]},
            "static": static}


def summarize(result: dict[str, Any]) -> str:
    lines = [f"{'':10s}{'utilization':>12s}{'SLO met':>9s}{'failed':>8s}{'steps':>8s}{'p99 s':>8s}"]
    for name, phase in (("lending", result), ("static", result["static"])):
        lines.append(f"{name:10s}{phase['utilization']:12.3f}{phase['slo_attainment']:9.4f}"
                     f"{phase['failed_requests']:8d}{phase['train_steps']:8d}{phase['p99_latency_s'] or 0:8.3f}")
    lines.append(f"{result['lends']} lends, {result['reclaims']} reclaims, {result['harvests']} harvests, "
                 f"{result['unharvests']} give-backs; objective p99 <= {result['slo_p99_s']}s; "
                 f"one replica serves {result['replica_capacity']} req/s, trough {result['trough_rate']} req/s; "
                 f"{result['harvested_device_s']} device-s trained beside replicas")
    hour_s = result["hour_s"]
    for at, kind, train, infer, took, rate, forecast, harvested in result["moves"]:
        ahead = f", forecast {forecast:.1f}" if forecast is not None else ""
        lines.append(f"  {at:6.1f}s (hour {at / hour_s:4.1f}) {kind:9s} -> train {train}, infer {infer} "
                     f"({harvested} shared) in {took:.1f}s (rate {rate:.1f}{ahead} req/s)")
    bounds = ", ".join(f"{bound:.3f} with replicas at most {cap} busy" for cap, bound in result["utilization_bound"].items())
    lines.append(f"utilization bound for whole-device lending (free moves): {bounds}")
    lines.append(f"load average before {result['load_average']['before']}, after {result['load_average']['after']}")
    for name, phase in (("lending", result), ("static", result["static"])):
        lines.append(f"  {name} SLO attainment by hour: {phase['hourly_slo_attainment']}")
    return "\n".join(lines)
