import pytest

from baige_ray.ops import metrics
from baige_ray.ops.metrics import JobMetrics, ServingMetrics, estimate_mfu


def test_mfu_is_six_n_flops_per_token_over_peak():
    # 1B parameters at 10k tokens/s on 2 devices of 100 TFLOP/s: 6e13 / 2e14.
    assert estimate_mfu(10_000, 1_000_000_000, 2, 100e12) == pytest.approx(0.3)
    assert estimate_mfu(0, 10, 1, 1.0) == 0.0


def test_mfu_of_gpt3_on_a100s_matches_the_papers_order():
    # GPT-3 175B at 140k tokens/s on 1,024 A100 (312 TFLOP/s): about 46% (Narayanan et al. 2021 report ~44-52%).
    assert estimate_mfu(140_000, 175e9, 1024, 312e12) == pytest.approx(0.46, abs=0.01)


@pytest.mark.parametrize("field, args", [
    ("tokens_per_s", (-1, 10, 1, 1.0)),
    ("num_parameters", (1, 0, 1, 1.0)),
    ("num_devices", (1, 10, 0, 1.0)),
    ("peak_flops_per_device", (1, 10, 1, 0.0)),
])
def test_mfu_rejects_bad_inputs_naming_the_field(field, args):
    with pytest.raises(ValueError, match=field):
        estimate_mfu(*args)


def test_every_recorder_supplies_all_tag_keys_of_its_metrics():
    # Ray validates tags strictly: a recorder missing a tag key raises ValueError here.
    job = JobMetrics(job="demo", pool="pool-a")
    job.step(step_time_s=0.2, tokens_per_s=1000.0, mfu=0.4, num_workers=8)
    job.worker_step(node="node-1", worker=3, device=1, step_time_s=0.21)
    job.recovery(1.5)
    job.snapshot_stall(0.002, node="node-1", worker=3)
    job.devices(train=6, infer=2)
    serving = ServingMetrics(app="gpt")
    serving.request(latency_s=0.05, ok=False, replica="r1", node="node-0")
    serving.queue_depth(4, replica="r1")
    serving.tokens(prompt_tokens=12, generated_tokens=8, time_to_first_token_s=0.03,
                   time_per_output_token_s=0.01, replica="r1", node="node-0")
    serving.engine_requests(running=3, waiting=1, replica="r1")
    # A request the engine failed before its first token: nothing to count, and no error from Ray's counter.
    serving.tokens(prompt_tokens=5, generated_tokens=0, time_to_first_token_s=None, time_per_output_token_s=None,
                   replica="r1", node="node-0")
    serving.kv_blocks({"device": 7, "host": 2, "disk": 0}, replica="r1")
    created = {name: m.info["tag_keys"] for name, m in metrics.registered_metrics().items()}
    assert created["baige_worker_step_time_seconds"] == ("pool", "job", "node", "worker", "device")
    assert created["baige_request_latency_seconds"] == ("pool", "app", "replica", "node")
    assert all(name.startswith("baige_") for name in created)
    # EXPORTED_NAMES (what dashboards and the Prometheus test look for) lists every metric made.
    exported = {name.removeprefix("ray_").removesuffix("_bucket").removesuffix("_total")
                for name in metrics.EXPORTED_NAMES}
    assert exported == set(created)


def test_wrappers_share_one_ray_metric_per_name():
    JobMetrics(job="a").recovery(1.0)
    JobMetrics(job="b").recovery(2.0)
    recovery = metrics.registered_metrics()["baige_recovery_seconds"]
    JobMetrics(job="c").recovery(3.0)
    assert metrics.registered_metrics()["baige_recovery_seconds"] is recovery


@pytest.mark.parametrize("call, message", [
    (lambda: JobMetrics(job="j").step(step_time_s=-1, tokens_per_s=1, mfu=0.1, num_workers=1), "step_time_s=-1"),
    (lambda: JobMetrics(job="j").devices(train=-2, infer=0), "train=-2"),
    (lambda: ServingMetrics(app="a").queue_depth(-1, replica="r"), "n=-1"),
    (lambda: ServingMetrics(app="a").request(latency_s="fast", replica="r", node="n"), "latency_s='fast'"),
])
def test_bad_values_are_rejected(call, message):
    with pytest.raises(ValueError, match=message):
        call()
