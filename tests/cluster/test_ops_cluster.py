"""`baige-ray status` and `baige-ray plot timeline` against an elastic job running on the simulated cluster."""

from __future__ import annotations

import json
import time

import pytest

from baige_ray.api.configs import RunConfig, ScalingConfig, TrainConfig
from baige_ray.api.elastic import ElasticConfig
from baige_ray.cli import main
from baige_ray.jobs.launch import launch
from baige_ray.models.mlp import MLPConfig
from baige_ray.ops.events import read_events
from baige_ray.ops.status import fetch_status, find_runs

RUN_NAME = "ops-status"
MIN_STEP = 5
DEADLINE_S = 90.0


@pytest.fixture(scope="module")
def running_job(sim_cluster, tmp_path_factory):
    run = RunConfig(name=RUN_NAME, storage_path=tmp_path_factory.mktemp("runs"), show_progress=False)
    job = launch(MLPConfig(sizes=(16, 32, 8)), train=TrainConfig(num_steps=100_000, global_batch_size=8),
                 scaling=ScalingConfig(num_workers=4), run=run, elastic=ElasticConfig(num_spares=1))
    try:
        yield job, run
    finally:
        job.stop()
        job.wait(timeout_s=DEADLINE_S)


def _status_when_running(job) -> dict:
    deadline = time.monotonic() + DEADLINE_S
    while time.monotonic() < deadline:
        status = job.status()
        if status["state"] == "running" and status["step"] >= MIN_STEP:
            return status
        time.sleep(0.5)
    raise AssertionError(f"the job did not reach step {MIN_STEP} within {DEADLINE_S} s: {status}")


def test_status_command_shows_the_running_job(running_job, capsys):
    job, _ = running_job
    status = _status_when_running(job)
    assert RUN_NAME in find_runs()
    assert main(["status", "--name", RUN_NAME]) == 0
    text = capsys.readouterr().out  # Ray's worker logs may be interleaved on stdout
    assert any(line.startswith(f"job {RUN_NAME}: running, step ") for line in text.splitlines())
    assert f"on {status['num_workers']} workers" in text
    nodes = {worker["node_ip"] for worker in status["workers"]}
    assert sum(text.count(f"{ip} (") for ip in nodes) >= 1  # one row per node holding workers
    start = next(line for line in text.splitlines() if " start " in line)
    assert "train_devices=4" in start and "infer_devices" not in start  # serving is the arbiter's to report
    assert "steps/s, goodput " in text


def test_status_json_is_the_controllers_status(running_job, capsys):
    _status_when_running(running_job[0])
    assert main(["status", "--json"]) == 0  # the only job: no --name needed
    printed = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert printed["name"] == RUN_NAME and printed["state"] == "running"
    assert printed["step"] >= MIN_STEP and 0 < printed["goodput"] <= 1
    assert set(printed) >= {"layout", "num_workers", "num_spares", "workers", "events", "steps_per_s",
                            "started_at", "elapsed_s"}
    assert fetch_status(RUN_NAME)["name"] == RUN_NAME


def test_timeline_plot_of_the_live_event_log(running_job, tmp_path, capsys):
    job, run = running_job
    _status_when_running(job)
    events_path = run.run_dir / "events.jsonl"
    events = read_events(events_path)
    assert [e["kind"] for e in events[:2]] == ["plan", "start"]
    out = tmp_path / "timeline.png"
    assert main(["plot", "timeline", str(events_path), "--out", str(out)]) == 0
    assert capsys.readouterr().out.strip().splitlines()[-1] == str(out)
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5_000
