"""Metrics recorded in a Ray actor reach the node's Prometheus endpoint (Ray's metrics agent)."""

from __future__ import annotations

import time
import urllib.request

import pytest
import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from baige_ray.ops.metrics import EXPORTED_NAMES

pytestmark = pytest.mark.ray
DEADLINE_S = 45.0  # the agent exports every ~5 s (RAY_metrics_report_interval_ms); allow several rounds on a busy box


@ray.remote(num_cpus=0)
class MetricsRecorder:
    def record(self) -> None:
        from baige_ray.ops.metrics import JobMetrics, ServingMetrics

        job = JobMetrics(job="metrics-test", pool="test-pool")
        job.step(step_time_s=0.25, tokens_per_s=4096.0, mfu=0.31, num_workers=4)
        job.worker_step(node="node-0", worker=2, device=1, step_time_s=0.26)
        job.recovery(1.2)
        job.snapshot_stall(0.003, node="node-0", worker=2)
        job.devices(train=3, infer=1)
        serving = ServingMetrics(app="gpt", pool="test-pool")
        serving.request(latency_s=0.04, ok=True, replica="replica-0", node="node-0")
        serving.queue_depth(5, replica="replica-0")
        serving.tokens(prompt_tokens=12, generated_tokens=8, time_to_first_token_s=0.03,
                       time_per_output_token_s=0.01, replica="replica-0", node="node-0")
        serving.engine_requests(running=3, waiting=1, replica="replica-0")
        serving.kv_blocks({"device": 7, "host": 2, "disk": 0}, replica="replica-0")


def test_recorded_metrics_appear_in_prometheus_output(local_ray):
    # On the driver's node, whose agent this test can reach on 127.0.0.1.
    node_id = ray.get_runtime_context().get_node_id()
    recorder = MetricsRecorder.options(
        scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False)).remote()
    try:
        ray.get(recorder.record.remote())
        text = _scrape_until(_metrics_url(node_id), EXPORTED_NAMES)
    finally:
        ray.kill(recorder)  # after the scrape: a dead worker's unsent metrics would be lost
    missing = [name for name in EXPORTED_NAMES if name not in text]
    assert not missing, f"not exported within {DEADLINE_S} s: {missing}"
    lines = text.splitlines()
    # Jobs run earlier in this Ray session export the same metric: take this recorder's line.
    worker_lines = [line for line in lines if line.startswith("ray_baige_worker_step_time_seconds_count")
                    and 'job="metrics-test"' in line]
    assert len(worker_lines) == 1, worker_lines
    for tag in ('pool="test-pool"', 'node="node-0"', 'worker="2"', 'device="1"'):
        assert tag in worker_lines[0]
    inference = next(line for line in lines if line.startswith("ray_baige_devices_held{")
                     and 'holder="inference"' in line and 'job="metrics-test"' in line)
    assert inference.rsplit(" ", 1)[1] == "1.0"


def _metrics_url(node_id: str) -> str:
    # Every node's metrics agent serves Prometheus text on its MetricsExportPort.
    node = next(n for n in ray.nodes() if n["NodeID"] == node_id)
    return f"http://127.0.0.1:{node['MetricsExportPort']}/metrics"


def _scrape_until(url: str, names: tuple[str, ...]) -> str:
    deadline = time.monotonic() + DEADLINE_S
    text = ""
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url, timeout=5) as response:
                text = response.read().decode()
        except OSError:
            text = ""  # the agent may still be starting
        if all(name in text for name in names):
            return text
        time.sleep(0.5)
    return text
