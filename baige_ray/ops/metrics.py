"""Training and serving metrics through `ray.util.metrics`, so they reach Ray's Prometheus endpoint.

Ray exports every metric with a `ray_` prefix: `baige_step_time_seconds` is
scraped as `ray_baige_step_time_seconds_bucket` and friends, counters gain
`_total`. Tags follow the resource hierarchy the dashboards slice by: pool, job,
node, worker, device for training; pool, app, replica, node for serving.

Create `JobMetrics` / `ServingMetrics` inside the process that records (an actor
or Ray worker): Ray's metrics are per process and flushed by the node's metrics
agent every few seconds.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from baige_ray.api.validation import require_number

PREFIX = "baige_"
JOB_TAGS = ("pool", "job")
WORKER_TAGS = ("pool", "job", "node", "worker", "device")
SNAPSHOT_TAGS = ("pool", "job", "node", "worker")
DEVICE_HOLDER_TAGS = ("pool", "job", "holder")
SERVING_TAGS = ("pool", "app", "replica", "node")
QUEUE_TAGS = ("pool", "app", "replica")
KV_TAGS = ("pool", "app", "replica", "tier")
FLOPS_PER_PARAMETER_TOKEN = 6  # forward 2N + backward 4N per token (Kaplan et al. 2020)

STEP_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
RECOVERY_BUCKETS_S = (0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)
STALL_BUCKETS_S = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 5.0)
LATENCY_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
TOKEN_GAP_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5)


def estimate_mfu(tokens_per_s: float, num_parameters: int, num_devices: int, peak_flops_per_device: float) -> float:
    """Model FLOPs utilization: 6 * N FLOPs per trained token over the devices' peak FLOP/s."""
    require_number("estimate_mfu", "tokens_per_s", tokens_per_s, minimum=0)
    require_number("estimate_mfu", "num_parameters", num_parameters, minimum=0, exclusive_minimum=True)
    require_number("estimate_mfu", "num_devices", num_devices, minimum=0, exclusive_minimum=True)
    require_number("estimate_mfu", "peak_flops_per_device", peak_flops_per_device, minimum=0, exclusive_minimum=True)
    return FLOPS_PER_PARAMETER_TOKEN * num_parameters * tokens_per_s / (num_devices * peak_flops_per_device)


_REGISTRY: dict[str, Any] = {}  # full name -> Ray metric object of this process


def _metric(kind: str, name: str, description: str, tag_keys: tuple[str, ...],
            boundaries: tuple[float, ...] = ()) -> Any:
    """One Ray metric object per name and process, however many wrappers a process creates."""
    full_name = PREFIX + name
    if full_name not in _REGISTRY:
        _REGISTRY[full_name] = _new_metric(kind, full_name, description, tag_keys, boundaries)
    metric = _REGISTRY[full_name]
    assert metric.info["tag_keys"] == tag_keys, (full_name, tag_keys)
    return metric


def _new_metric(kind: str, full_name: str, description: str, tag_keys: tuple[str, ...],
                boundaries: tuple[float, ...]) -> Any:
    from ray.util import metrics

    if kind == "histogram":
        return metrics.Histogram(full_name, description=description, boundaries=list(boundaries), tag_keys=tag_keys)
    if kind == "gauge":
        return metrics.Gauge(full_name, description=description, tag_keys=tag_keys)
    assert kind == "counter", kind
    return metrics.Counter(full_name, description=description, tag_keys=tag_keys)


def registered_metrics() -> dict[str, Any]:
    """The Ray metric objects this process has created, by full name."""
    return dict(_REGISTRY)


def _tags(**values: Any) -> dict[str, str]:
    return {key: str(value) for key, value in values.items()}


def _require_seconds(owner: str, field: str, value: float) -> None:
    require_number(owner, field, value, minimum=0)


@dataclass(frozen=True)
class JobMetrics:
    """Metrics of one training job in one resource pool."""

    job: str
    pool: str = "default"

    def step(self, *, step_time_s: float, tokens_per_s: float, mfu: float, num_workers: int) -> None:
        """One completed training step, job-wide."""
        _require_seconds("JobMetrics.step", "step_time_s", step_time_s)
        require_number("JobMetrics.step", "tokens_per_s", tokens_per_s, minimum=0)
        require_number("JobMetrics.step", "mfu", mfu, minimum=0)
        require_number("JobMetrics.step", "num_workers", num_workers, minimum=0)
        tags = self._job_tags()
        _metric("histogram", "step_time_seconds", "Training step wall time", JOB_TAGS,
                STEP_BUCKETS_S).observe(step_time_s, tags=tags)
        _metric("gauge", "tokens_per_second", "Training throughput in tokens per second",
                JOB_TAGS).set(tokens_per_s, tags=tags)
        _metric("gauge", "mfu", "Model FLOPs utilization estimate (6N FLOPs per token over peak)",
                JOB_TAGS).set(mfu, tags=tags)
        _metric("gauge", "workers", "Worker actors training", JOB_TAGS).set(num_workers, tags=tags)
        _metric("counter", "steps", "Training steps completed", JOB_TAGS).inc(1, tags=tags)

    def expert_imbalance(self, ratio: float) -> None:
        """max / mean routed tokens per expert in the last step's worst MoE layer."""
        _metric("gauge", "expert_imbalance", "Routed tokens per expert, max over mean, worst MoE layer of the step",
                JOB_TAGS).set(ratio, tags=self._job_tags())

    def worker_step(self, *, node: str, worker: int | str, device: int | str, step_time_s: float) -> None:
        """One worker's time for a step: the per-device view that exposes stragglers."""
        _require_seconds("JobMetrics.worker_step", "step_time_s", step_time_s)
        _metric("histogram", "worker_step_time_seconds", "Step time seen by one worker", WORKER_TAGS,
                STEP_BUCKETS_S).observe(step_time_s, tags=_tags(pool=self.pool, job=self.job, node=node,
                                                               worker=worker, device=device))

    def recovery(self, seconds: float) -> None:
        """Time from a detected failure to the next completed step."""
        _require_seconds("JobMetrics.recovery", "seconds", seconds)
        tags = self._job_tags()
        _metric("histogram", "recovery_seconds", "Failure detected to next completed step", JOB_TAGS,
                RECOVERY_BUCKETS_S).observe(seconds, tags=tags)
        _metric("counter", "recoveries", "Recoveries from failures", JOB_TAGS).inc(1, tags=tags)

    def snapshot_stall(self, seconds: float, *, node: str, worker: int | str) -> None:
        """Time a worker's training loop waited on an in-memory snapshot."""
        _require_seconds("JobMetrics.snapshot_stall", "seconds", seconds)
        _metric("histogram", "snapshot_stall_seconds", "Training time blocked by a state snapshot",
                SNAPSHOT_TAGS, STALL_BUCKETS_S).observe(
                    seconds, tags=_tags(pool=self.pool, job=self.job, node=node, worker=worker))

    def devices(self, *, train: int, infer: int) -> None:
        """Devices held by training and devices lent to inference."""
        require_number("JobMetrics.devices", "train", train, minimum=0)
        require_number("JobMetrics.devices", "infer", infer, minimum=0)
        gauge = _metric("gauge", "devices_held", "Devices held, by holder (training / inference)",
                        DEVICE_HOLDER_TAGS)
        gauge.set(train, tags=_tags(pool=self.pool, job=self.job, holder="training"))
        gauge.set(infer, tags=_tags(pool=self.pool, job=self.job, holder="inference"))

    def _job_tags(self) -> dict[str, str]:
        return _tags(pool=self.pool, job=self.job)


@dataclass(frozen=True)
class ServingMetrics:
    """Metrics of one served application in one resource pool."""

    app: str
    pool: str = "default"

    def request(self, *, latency_s: float, ok: bool = True, replica: str, node: str) -> None:
        """One finished request: latency histogram and a counter by status (ok / error)."""
        _require_seconds("ServingMetrics.request", "latency_s", latency_s)
        tags = _tags(pool=self.pool, app=self.app, replica=replica, node=node)
        _metric("histogram", "request_latency_seconds", "Inference request latency", SERVING_TAGS,
                LATENCY_BUCKETS_S).observe(latency_s, tags=tags)
        _metric("counter", "requests", "Inference requests finished, by status", SERVING_TAGS + ("status",)).inc(
            1, tags={**tags, "status": "ok" if ok else "error"})

    def tokens(self, *, prompt_tokens: int, generated_tokens: int, time_to_first_token_s: float | None,
               time_per_output_token_s: float | None, replica: str, node: str) -> None:
        """One request's tokens and their timing, as vLLM's server reports them: prompt and generation token
        counters, time to first token and the mean time per output token after it."""
        tags = _tags(pool=self.pool, app=self.app, replica=replica, node=node)
        for name, description, count in (("prompt_tokens", "Prompt tokens of the requests taken", prompt_tokens),
                                         ("generation_tokens", "Tokens generated", generated_tokens)):
            require_number("ServingMetrics.tokens", name, count, minimum=0)
            if count:  # a Ray counter refuses an increment of 0 (a request that failed before its first token)
                _metric("counter", name, description, SERVING_TAGS).inc(count, tags=tags)
        if time_to_first_token_s is not None:
            _require_seconds("ServingMetrics.tokens", "time_to_first_token_s", time_to_first_token_s)
            _metric("histogram", "time_to_first_token_seconds", "Request taken to its first token", SERVING_TAGS,
                    LATENCY_BUCKETS_S).observe(time_to_first_token_s, tags=tags)
        if time_per_output_token_s is not None:
            _require_seconds("ServingMetrics.tokens", "time_per_output_token_s", time_per_output_token_s)
            _metric("histogram", "time_per_output_token_seconds", "A request's mean time per token after its first",
                    SERVING_TAGS, TOKEN_GAP_BUCKETS_S).observe(time_per_output_token_s, tags=tags)

    def engine_requests(self, *, running: int, waiting: int, replica: str) -> None:
        """Requests one replica's engine decodes now, and those waiting for a slot in its batch."""
        tags = _tags(pool=self.pool, app=self.app, replica=replica)
        _metric("gauge", "requests_running", "Requests in a replica's decoding batch", QUEUE_TAGS).set(running, tags=tags)
        _metric("gauge", "requests_waiting", "Requests waiting for a slot in a replica's batch", QUEUE_TAGS).set(
            waiting, tags=tags)

    def kv_blocks(self, blocks: dict[str, int], *, replica: str) -> None:
        """Prefix-cache blocks one replica holds, per tier (device, host, disk: serving/kv_blocks.py)."""
        gauge = _metric("gauge", "kv_blocks", "Prefix-cache blocks a replica holds, by tier", KV_TAGS)
        for tier, count in blocks.items():
            require_number("ServingMetrics.kv_blocks", tier, count, minimum=0)
            gauge.set(count, tags=_tags(pool=self.pool, app=self.app, replica=replica, tier=tier))

    def queue_depth(self, n: int, *, replica: str) -> None:
        """Requests waiting at one replica."""
        require_number("ServingMetrics.queue_depth", "n", n, minimum=0)
        _metric("gauge", "queue_depth", "Requests queued at a replica", QUEUE_TAGS).set(
            n, tags=_tags(pool=self.pool, app=self.app, replica=replica))


# Names as Prometheus shows them after Ray's `ray_` prefix, for dashboards and tests.
EXPORTED_NAMES = tuple("ray_" + PREFIX + name for name in (
    "step_time_seconds_bucket", "tokens_per_second", "mfu", "workers", "steps_total",
    "worker_step_time_seconds_bucket", "recovery_seconds_bucket", "recoveries_total",
    "snapshot_stall_seconds_bucket", "devices_held", "request_latency_seconds_bucket", "requests_total",
    "queue_depth", "prompt_tokens_total", "generation_tokens_total", "time_to_first_token_seconds_bucket",
    "time_per_output_token_seconds_bucket", "requests_running", "requests_waiting", "kv_blocks",
))
