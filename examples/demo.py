"""What baige-ray is for, in three minutes: plan, train, survive a SIGKILL, lend a device to serving, take it back.

Launch (what `make demo` runs):

    .venv/bin/python examples/demo.py            # add --verbose for Ray's and Serve's own logs

On a simulated cluster of 2 nodes x 4 GPUs (Ray's fake resources; the work runs on this CPU), a
Llama-architecture Hugging Face model (its tokenizer trained here on local text, its weights fresh):

1. the planner lays the job out on the cluster's resource graph and says why the runner-up lost;
2. the job trains with a live progress line (step, loss, tokens/s, MFU, workers);
3. one worker process is killed with SIGKILL in the middle of a step: the controller detects it,
   a warm spare takes the rank, the step is redone from the in-memory snapshots, training goes on;
4. the model is served from training's in-memory weights (OpenAI-compatible /v1/completions); a
   request load arrives, the pool arbiter lends a training device to a second replica, the load
   falls, the arbiter takes the device back;
5. a closing table: the loss against a fault-free run of the same steps, recovery, serving, and
   pool utilization, and a timeline of the devices (PNG).

Ray's and Serve's logs go to the run directory (printed at the start). Every run gets its own run
directory; the model, tokenizer and dataset are made once in --workdir and reused.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import signal
import statistics
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from openai import OpenAI
from tqdm import tqdm

import baige_ray as br
from baige_ray.actors.arbiter import ArbiterConfig, start_pool_arbiter
from baige_ray.bench.colocate_accounting import PoolSampler, infer_device_seconds, train_device_seconds
from baige_ray.engines.train_job import TrainJob
from baige_ray.models.hf.tiny import make_llama_tiny
from baige_ray.ops.events import read_events
from baige_ray.ops.log_capture import stderr_to_file
from baige_ray.ops.plots import plot_timeline
from baige_ray.planner.report import explain_text
from baige_ray.policies.lending import LendingPolicy
from baige_ray.runtime.auto_plan import first_devices, layout_from_plan, live_graph, plan_job
from baige_ray.runtime.progress import JobProgress
from baige_ray.serving import serve, shutdown

NUM_WORKERS, MIN_WORKERS, POOL_DEVICES = 4, 3, 8
# Constant learning rate after the warm-up: the first steps of any run, however long, are the same
# steps, so a short fault-free run is the reference for this one's beginning.
TRAIN = br.TrainConfig(num_steps=600, global_batch_size=12, learning_rate=2e-3, min_learning_rate=2e-3,
                       warmup_steps=10)
REPLICA_CAPACITY = 1.5  # requests/s one replica is sized for (the arbiter's figure, not a measurement)
BUSY_RATE, QUIET_RATE = 3.0, 0.3  # requests/s: twice what one replica is sized for, then a trickle
PROMPTS = ("def ", "import os\n", "class Parser", "for line in ", "return self.")


def say(text: str = "") -> None:
    """Print above the progress line without breaking it."""
    tqdm.write(text, file=sys.stdout)


def part(number: int, title: str) -> None:
    say(f"\n{number}. {title}")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", type=Path, default=Path.home() / "baige_ray_results" / "demo")
    parser.add_argument("--cluster", default="sim-2x4", help="a descriptor's name or YAML path")
    parser.add_argument("--kill-at", type=int, default=15, help="step in which a worker is killed")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--verbose", action="store_true", help="Ray's and Serve's logs on the terminal too")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    run_name = time.strftime("demo-%Y%m%d-%H%M%S")
    run_dir = args.workdir / "runs" / run_name
    started = time.monotonic()
    print(f"baige-ray demo: run directory {run_dir}")
    with stderr_to_file(run_dir / "ray-and-serve.log", enabled=not args.verbose) as log:
        if log is not None:
            print(f"  Ray's and Serve's logs: {log} (--verbose shows them here)")
        model, dataset = prepare(args.workdir)
        with br.open_cluster(args.cluster, log_to_driver=args.verbose):
            say(f"  cluster: {POOL_DEVICES} simulated GPUs on 2 nodes ({args.cluster}), up after "
                f"{time.monotonic() - started:.0f}s")
            report = run_story(model, dataset, args, run_name, run_dir)
        part(5, "Summary")
        say(report.table(time.monotonic() - started))


def run_story(model, dataset, args: argparse.Namespace, run_name: str, run_dir: Path) -> Report:
    report = Report()
    layout = show_plan(model, dataset)
    job = start_training(model, dataset, layout, run_name, run_dir.parent)
    progress = JobProgress(job.status, TRAIN.num_steps, file=sys.stdout).start()
    try:
        report.fault = kill_a_worker(job, args.kill_at)
        report.serving = lend_under_load(job, model, run_dir, args.port)
        job.stop()
        report.result = job.wait(timeout_s=120)
    except BaseException:
        job.kill()
        raise
    finally:
        progress.close()
    report.reference = fault_free_losses(model, dataset, report.fault["resumed_step"] + 10, run_dir)
    report.timeline = plot_timeline(events_of(run_dir), run_dir / "timeline.png")
    return report


# ----- the model and data ------------------------------------------------------------------------


def prepare(workdir: Path):
    say("  model and data: a Llama config and a byte-level BPE tokenizer trained on local text, saved as a "
        "Hugging Face directory (made once, then reused)")
    model, dataset = make_llama_tiny(workdir)
    import transformers

    hf = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(model.path))
    parameters = sum(p.numel() for p in hf.parameters())
    say(f"  {type(hf).__name__} from {model.path}: {parameters / 1e6:.1f}M parameters, "
        f"{model.config['num_hidden_layers']} layers, hidden {model.config['hidden_size']}, vocabulary "
        f"{model.vocab_size}; {dataset.num_sequences:,} sequences of {dataset.seq_len} tokens")
    return model, dataset


# ----- 1. the plan ------------------------------------------------------------------------------


def show_plan(model, dataset) -> br.ParallelLayout:
    part(1, f"Plan: the planner lays out {NUM_WORKERS} workers on the cluster's resource graph")
    graph = first_devices(live_graph(), NUM_WORKERS)
    chosen = plan_job(TrainJob(model=model, train=TRAIN, data=dataset), graph)
    lines = explain_text(chosen).splitlines()
    say("\n".join("  " + line for line in lines[1:4]))
    if chosen.alternatives:
        runner_up = chosen.alternatives[0]
        say(f"  runner-up  {runner_up.describe()}\n             lost by {runner_up.why_lost}")
    return layout_from_plan(chosen)


# ----- 2. training ------------------------------------------------------------------------------


def start_training(model, dataset, layout: br.ParallelLayout, run_name: str, storage: Path) -> br.TrainingJob:
    part(2, f"Train: an elastic job in that layout ({layout.describe()}), one warm spare")
    return br.launch(
        model, data=dataset, train=TRAIN, layout=layout,
        scaling=br.ScalingConfig(num_workers=NUM_WORKERS, cpu_niceness=10),  # serving gets the cores first
        run=br.RunConfig(name=run_name, storage_path=storage, show_progress=False),
        elastic=br.ElasticConfig(num_spares=1, min_workers=MIN_WORKERS, max_workers=NUM_WORKERS,
                                 peak_flops_per_device=cpu_peak_flops() / NUM_WORKERS),
    )


def cpu_peak_flops() -> float:
    """This machine's float32 matrix-multiply throughput, shared by the simulated devices (for MFU)."""
    a = torch.randn(1024, 1024)
    a @ a
    began, count = time.perf_counter(), 0
    while time.perf_counter() - began < 0.3:
        a @ a
        count += 1
    return 2 * 1024**3 * count / (time.perf_counter() - began)


def wait_for(job: br.TrainingJob, ready, what: str, timeout_s: float = 120.0) -> dict:
    deadline = time.monotonic() + timeout_s
    while not ready(status := job.status()):
        if status["state"] in ("failed", "finished"):
            raise RuntimeError(f"training ended ({status['state']}) while waiting for {what}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"no {what} within {timeout_s:.0f}s (job state {status['state']})")
        time.sleep(0.1)
    return status


# ----- 3. a fault -------------------------------------------------------------------------------


def kill_a_worker(job: br.TrainingJob, step: int) -> dict:
    status = wait_for(job, lambda s: s["state"] == "running" and s["step"] >= step, f"step {step}")
    say(f"  layout {status['layout']} on {status['num_workers']} workers, {status['num_spares']} spare")
    time.sleep(0.5 / status["steps_per_s"] if status["steps_per_s"] else 0.0)  # into the middle of a step
    victim, earlier = status["workers"][1], len(status["recoveries"])
    killed_at = time.time()
    os.kill(victim["pid"], signal.SIGKILL)
    part(3, f"Fault: SIGKILL to the worker of rank 1 (pid {victim['pid']}) during step {job.status()['step']}")
    status = wait_for(job, lambda s: len(s["recoveries"]) > earlier, "recovery", timeout_s=60)
    recovery = status["recoveries"][earlier]
    after = [e for e in status["events"] if e["time"] >= killed_at]
    failure = next((e for e in after if e["kind"] == "failure"), None)
    regrouped = next((e for e in after if e["kind"] in ("recovered", "resize")), None)
    detected_s = failure["time"] - killed_at if failure else float("nan")
    say(f"  detected after {detected_s:.2f}s ({failure['reason'] if failure else 'no failure event'})")
    say(f"  {regrouped['reason'] if regrouped else 'regrouped'}: {regrouped['train_devices'] if regrouped else '?'} "
        f"workers resumed at step {recovery['resumed_step']} from the in-memory snapshots, "
        f"{recovery['lost_steps']} step(s) redone, the next step done {recovery['recovery_s']:.2f}s after the failure")
    return {"detected_s": detected_s, **recovery}


# ----- 4. serving beside training ---------------------------------------------------------------


@dataclass
class Load:
    """Completions at `rate` requests/s through the official OpenAI client (up to 8 in flight), every
    outcome kept."""

    client: OpenAI
    model: str
    rate: float
    latencies: list[float] = field(default_factory=list)
    tokens: int = 0
    failures: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._next_at = time.monotonic()
        self._sent = 0
        self._threads = [threading.Thread(target=self._send, daemon=True) for _ in range(8)]

    def start(self) -> Load:
        for thread in self._threads:
            thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=90)

    def _take_slot(self) -> tuple[float, int]:
        with self._lock:
            at, index = self._next_at, self._sent
            self._next_at = max(at, time.monotonic()) + 1 / self.rate
            self._sent += 1
            return at, index

    def _send(self) -> None:
        while not self._stop.is_set():
            at, index = self._take_slot()
            if self._stop.wait(max(0.0, at - time.monotonic())):
                return
            began = time.perf_counter()
            try:
                reply = self.client.completions.create(model=self.model, prompt=PROMPTS[index % len(PROMPTS)],
                                                       max_tokens=16, temperature=0.8, seed=index)
            except Exception as error:  # a failed request is a result of the demo, not its end
                with self._lock:
                    self.failures.append(f"{type(error).__name__}: {error}")
                continue
            with self._lock:
                self.latencies.append(time.perf_counter() - began)
                self.tokens += reply.usage.completion_tokens


def lend_under_load(job: br.TrainingJob, model, run_dir: Path, port: int) -> dict:
    part(4, "Serve: the model from training's in-memory weights, beside training")
    began = time.monotonic()
    info = serve(job, name="llama", port=port)
    say(f"  one replica up in {time.monotonic() - began:.0f}s at {info.url}/v1/completions")
    client = OpenAI(base_url=info.url + "/v1", api_key="not-needed", max_retries=0, timeout=60)
    arbiter = start_pool_arbiter(job.name, info, model, arbiter_config(run_dir))
    load = Load(client, "llama", BUSY_RATE).start()
    try:
        with PoolSampler(job, info) as sampler:
            phase_began = time.monotonic()
            say(f"  load: {BUSY_RATE:g} requests/s, twice what one replica is sized for")
            lent = wait_for_move(arbiter, "lend")
            sample = client.completions.create(model="llama", prompt="import os\n", max_tokens=24, temperature=0.7,
                                               seed=0)
            say(f"  a reply through the openai client while training runs: {'import os' + chr(10) + sample.choices[0].text!r}")
            time.sleep(5)
            load.rate = QUIET_RATE
            say(f"  load falls to {QUIET_RATE:g} requests/s")
            reclaimed = wait_for_move(arbiter, "reclaim")
            phase_s = time.monotonic() - phase_began
    finally:
        load.stop()
        import ray

        ray.get(arbiter.stop.remote())
        shutdown(info)
    samples = sampler.samples
    busy = train_device_seconds(samples, samples[0].at, samples[-1].at) + infer_device_seconds(samples)
    return {"lent": lent, "reclaimed": reclaimed, "latencies": load.latencies, "tokens": load.tokens,
            "failures": load.failures, "phase_s": phase_s,
            "utilization": busy / (POOL_DEVICES * (samples[-1].at - samples[0].at))}


def arbiter_config(run_dir: Path) -> ArbiterConfig:
    return ArbiterConfig(
        slo_p99_s=5.0, replica_capacity=REPLICA_CAPACITY, capacity_from_reports=False,
        min_train_devices=MIN_WORKERS, min_infer_devices=1, train_sizes=(MIN_WORKERS, NUM_WORKERS),
        poll_interval_s=1.0, load_window_s=4.0, trend_window_s=None, event_log=run_dir / "arbiter-events.jsonl",
        policy=LendingPolicy(lend_above=0.8, target_utilization=0.75, reclaim_below=0.3, cooldown_s=4.0,
                             breach_cooldown_s=4.0),
    )


def wait_for_move(arbiter, kind: str, timeout_s: float = 90.0) -> dict | None:
    """The arbiter's first `kind` event (lend or reclaim), said when it happens; None if none came."""
    import ray

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        events = ray.get(arbiter.status.remote())["events"]
        move = next((e for e in events if e["kind"] == kind), None)
        if move is not None:
            verb = "lent a training device to serving" if kind == "lend" else "took the device back for training"
            say(f"  arbiter {verb} at {move['request_rate']:.1f} requests/s: training {move['train_devices']} "
                f"devices, serving {move['infer_devices']} ({move['took_s']:.1f}s)")
            return move
        time.sleep(0.5)
    say(f"  the arbiter made no {kind} within {timeout_s:.0f}s")
    return None


# ----- 5. the closing table ---------------------------------------------------------------------


def fault_free_losses(model, dataset, num_steps: int, run_dir: Path) -> list[float]:
    say(f"\n  reference: the same model, data and seed for {num_steps} steps on 1 worker, without the fault")
    result = br.fit(model, data=dataset, train=dataclasses.replace(TRAIN, num_steps=num_steps),
                    scaling=br.ScalingConfig(num_workers=1),
                    run=br.RunConfig(name="fault-free", storage_path=run_dir, show_progress=False))
    return [m.loss for m in result.metrics]


def events_of(run_dir: Path) -> list[dict]:
    return [event for name in ("events.jsonl", "arbiter-events.jsonl")
            if (run_dir / name).exists() for event in read_events(run_dir / name)]


@dataclass
class Report:
    fault: dict | None = None
    serving: dict | None = None
    result: object = None
    reference: list[float] = field(default_factory=list)
    timeline: Path | None = None

    def table(self, wall_s: float) -> str:
        losses = {m.step: m.loss for m in self.result.metrics}
        compared = [step for step in range(len(self.reference)) if step in losses]
        worst = max(abs(losses[s] - self.reference[s]) / abs(self.reference[s]) for s in compared)
        last = compared[-1]
        serving = self.serving
        latencies = sorted(serving["latencies"])
        p99 = latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))] if latencies else float("nan")
        rows = [
            ("loss at step %d" % last, f"{losses[last]:.4f} (fault-free run {self.reference[last]:.4f}; "
                                       f"largest relative difference over steps 0-{last}: {worst:.1e})"),
            ("training", f"{len(losses)} steps, loss {self.result.metrics[0].loss:.3f} -> "
                         f"{self.result.metrics[-1].loss:.3f}"),
            ("SIGKILL recovery", f"detected in {self.fault['detected_s']:.2f}s, next step done "
                                 f"{self.fault['recovery_s']:.2f}s after the failure, "
                                 f"{self.fault['lost_steps']} step(s) redone"),
            ("serving", f"{len(latencies)} completions, {len(serving['failures'])} failed, "
                        f"{serving['tokens'] / serving['phase_s']:.0f} tokens/s, p50 "
                        f"{statistics.median(latencies) if latencies else float('nan'):.2f}s, p99 {p99:.2f}s"),
            ("lending", _moves(serving)),
            ("pool utilization", f"{serving['utilization']:.0%} of {POOL_DEVICES} devices busy while serving ran "
                                 "(training steps and replica compute)"),
            ("timeline", str(self.timeline)),
            ("demo wall time", f"{wall_s:.0f}s"),
        ]
        width = max(len(name) for name, _ in rows)
        return "\n".join(f"  {name:<{width}}  {value}" for name, value in rows)


def _moves(serving: dict) -> str:
    parts = []
    for kind in ("lent", "reclaimed"):
        move = serving[kind]
        parts.append(f"{kind} in {move['took_s']:.1f}s" if move else f"not {kind}")
    return ", ".join(parts)


if __name__ == "__main__":
    main()
