"""Lend a device from training to serving and take it back, under steady request load.

Served by the built-in engine (the lent replica built with the job's newest weights from memory).

The model is the tiny Llama of tests/hf_helpers.py (a `transformers` model with its own tokenizer and
TokenDataset); the byte GPT goes through the same path in test_harvest_cluster.py. No request may fail
across the lend and the reclaim, the lent replica must start with the current weights, and training's
loss curve must continue where it was (no reset to the first steps' loss).
"""

from __future__ import annotations

import json
import math
import os
import signal
import threading
import time
import urllib.error
import urllib.request

import pytest
import ray
import ray.util.state

import baige_ray as br
from baige_ray.actors.arbiter import ArbiterConfig, ArbiterLoop, JobTrainingSide, start_pool_arbiter
from baige_ray.actors.serving_sides import ServeServingSide
from baige_ray.api.connection import state_api_address
from baige_ray.api.elastic import ElasticConfig
from baige_ray.jobs.launch import launch
from baige_ray.ops.events import EventLog
from baige_ray.policies.lending import LendingAction, LendingPolicy
from baige_ray.serving import replica_states, serve, shutdown
from baige_ray.topology.head import head_node_id
from tests.hf_helpers import SEQ_LEN, VOCAB_SIZE, build_tiny_hf
from tests.helpers import free_port


class SteadyLoad:
    """Sends a generate request every `interval_s` on a thread; keeps every status."""

    def __init__(self, url: str, interval_s: float = 0.2):
        self.url, self.interval_s, self.statuses = url, interval_s, []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _one(self, index: int) -> int:
        body = json.dumps({"prompt": "def ", "max_new_tokens": 4, "seed": index}).encode()
        try:
            with urllib.request.urlopen(urllib.request.Request(self.url, data=body), timeout=60) as response:
                return response.status
        except urllib.error.HTTPError as error:
            return error.code
        except OSError:
            return 0

    def _run(self) -> None:
        index = 0
        while not self._stop.wait(self.interval_s):
            self.statuses.append(self._one(index))
            index += 1

    def __enter__(self) -> SteadyLoad:
        self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._stop.set()
        self._thread.join()


def health_steps(url: str, tries: int = 6) -> set[int]:
    return {json.loads(urllib.request.urlopen(url + "/health", timeout=30).read())["step"] for _ in range(tries)}


def loop_with_capacity(job, info, model, capacity: float, events: EventLog) -> ArbiterLoop:
    """An arbiter loop whose capacity estimate is fixed, so the steady load reads as high or low."""
    config = ArbiterConfig(slo_p99_s=30.0, replica_capacity=capacity, capacity_from_reports=False,
                           min_train_devices=3, train_sizes=(3, 4), load_window_s=3.0,
                           policy=LendingPolicy(cooldown_s=0.0, breach_cooldown_s=0.0))
    return ArbiterLoop(JobTrainingSide(job.name), ServeServingSide(info, model), config,
                       events=events)


@pytest.fixture(scope="module")
def job_and_app(sim_cluster, tmp_path_factory):
    """The job and the app, served by the built-in engine (vLLM takes later weights in place through the
    same reload: tests/ray/test_vllm_serving.py)."""
    tiny = build_tiny_hf(tmp_path_factory.mktemp("tiny-llama-colocate"), num_hidden_layers=2)
    model = br.HFModel(tiny.model_dir, seq_len=SEQ_LEN)
    job = launch(model, data=br.TokenDataset.open(tiny.dataset_dir),
                 train=br.TrainConfig(num_steps=100_000, global_batch_size=12, warmup_steps=2),
                 scaling=br.ScalingConfig(num_workers=4), run=br.RunConfig(name="colocate-builtin"),
                 elastic=ElasticConfig(min_workers=3, max_workers=4))
    deadline = time.monotonic() + 120
    while (status := job.status())["state"] != "running" or status["step"] < 5:
        assert time.monotonic() < deadline, f"training did not start: {status['state']}"
        time.sleep(0.5)
    info = serve(job.latest_model_state(), model_config=model, name="colocate-builtin", port=free_port())
    yield job, info, model
    shutdown(info)
    try:
        job.stop()
    except Exception:  # the test already stopped the job and its controller is gone
        pass


def test_a_killed_arbiter_is_restarted_on_the_head_node_and_arbitrates_again(job_and_app, tmp_path):
    """SIGKILL to the PoolArbiter's process: Ray starts it again, it logs the restart and keeps deciding
    (a capacity this high holds the split, so the pool is left as the next test expects it)."""
    job, info, model = job_and_app
    config = ArbiterConfig(slo_p99_s=30.0, replica_capacity=1000.0, capacity_from_reports=False,
                           train_sizes=(3, 4), poll_interval_s=0.2, event_log=tmp_path / "arbiter.jsonl")
    arbiter = start_pool_arbiter(job.name, info, model, config)
    try:
        before = ray.get(arbiter.status.remote(), timeout=60)
        os.kill(before["pid"], signal.SIGKILL)
        deadline = time.monotonic() + 60
        while True:
            try:
                after = ray.get(arbiter.status.remote(), timeout=10)
                if after["pid"] != before["pid"] and after["last_decision"] is not None:
                    break
            except ray.exceptions.RayActorError:  # dead, not yet restarted
                pass
            assert time.monotonic() < deadline, "the arbiter did not come back"
            time.sleep(0.2)
        node = ray.util.state.get_actor(arbiter._actor_id.hex(), address=state_api_address()).node_id
        assert node == head_node_id()
        kinds = [json.loads(line)["kind"] for line in (tmp_path / "arbiter.jsonl").read_text().splitlines()]
        assert kinds[0] == "start" and "arbiter_restart" in kinds and after["last_decision"]["action"] == "hold"
        assert (after["train_devices"], after["infer_devices"]) == (4, 1)
    finally:
        ray.kill(arbiter, no_restart=True)


def test_lend_and_reclaim_lose_no_request_and_training_continues(job_and_app):
    job, info, model = job_and_app
    events = EventLog(None)
    with SteadyLoad(info.url + "/generate") as load:
        time.sleep(4)  # a load window of requests before deciding
        step_at_lend = job.status()["step"]
        lend = loop_with_capacity(job, info, model, capacity=0.5, events=events).tick()  # ~5 req/s reads as overload
        assert (lend.action, lend.num_devices) == (LendingAction.LEND, 1)
        assert replica_states(info) == {"RUNNING": 2} and job.status()["num_workers"] == 3
        assert min(health_steps(info.url)) >= step_at_lend  # the lent replica serves current weights
        time.sleep(3)
        reclaim = loop_with_capacity(job, info, model, capacity=1000.0, events=events).tick()
        assert (reclaim.action, reclaim.num_devices) == (LendingAction.RECLAIM, 1)
        assert replica_states(info) == {"RUNNING": 1} and job.status()["num_workers"] == 4
        time.sleep(2)
    assert load.statuses and set(load.statuses) == {200}, f"failed requests: {load.statuses}"
    assert [(e["kind"], e["train_devices"], e["infer_devices"]) for e in events.recent()] == [
        ("lend", 3, 2), ("reclaim", 4, 1)]

    assert_training_continues(job, since_step=step_at_lend)


def assert_training_continues(job, since_step: int) -> None:
    """Train 5 more steps, stop, and check the loss curve went on from where it was (no reset) since `since_step`."""
    resumed_after = job.status()["step"]
    while job.status()["step"] < resumed_after + 5:
        time.sleep(0.5)
    job.stop()
    metrics = job.wait(timeout_s=120).metrics
    steps = [m.step for m in metrics]
    assert steps == sorted(steps) and steps[-1] > resumed_after
    first_loss = metrics[0].loss
    assert first_loss == pytest.approx(math.log(VOCAB_SIZE), rel=0.1)
    later = [m.loss for m in metrics if m.step >= since_step]
    # No reset: after the moves the loss stays near where it was, well below the start.
    assert max(later) < first_loss - 0.5
