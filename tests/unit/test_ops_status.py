import time

import pytest

from baige_ray.cli import main
from baige_ray.ops.status import choose_run, compress_ranges, format_duration, format_event, format_status

NODE_A = "a3f1" * 14  # Ray node ids: 56 hex characters
NODE_B = "b7c2" * 14


def _status(**overrides):
    started = time.time() - 125.0
    events = [
        {"time": started + 1, "kind": "plan", "reason": "planner: dp=4 tp=2 fastest", "layout": "dp=4,tp=2"},
        {"time": started + 2, "kind": "start", "reason": "8 workers up"},
        {"time": started + 40, "kind": "failure", "reason": "actor died", "rank": 5, "node_id": NODE_B},
        {"time": started + 41, "kind": "recovered", "reason": "spare took rank 5", "step": 61},
        {"time": started + 90, "kind": "lend", "reason": "queue rising", "train_devices": 6, "infer_devices": 2},
    ]
    workers = [{"rank": r, "node_id": NODE_A if r < 4 else NODE_B, "node_ip": "10.0.0.1" if r < 4 else "10.0.0.2",
                "device_index": r % 4, "pid": 1000 + r} for r in (0, 1, 2, 3, 4, 5, 7)]
    status = {"name": "demo", "state": "running", "step": 120, "num_steps": 300, "layout": "dp=3,tp=2",
              "num_workers": 6, "num_spares": 1, "workers": workers, "events": events, "steps_per_s": 1.5,
              "goodput": 0.923, "started_at": started, "elapsed_s": 125.0}
    status.update(overrides)
    return status


def test_summary_shows_state_progress_plan_rates_nodes_and_events():
    text = format_status(_status())
    lines = text.splitlines()
    assert lines[0] == "job demo: running, step 120/300 (40%), elapsed 2m05s"
    assert lines[1] == "layout dp=3,tp=2 on 6 workers (+1 spare)"
    assert lines[2] == "1.5 steps/s, goodput 92.3%, about 2m00s to go"
    assert "10.0.0.1 (a3f1a3f1): 4 workers, ranks 0-3, devices 0,1,2,3" in text
    assert "10.0.0.2 (b7c2b7c2): 3 workers, ranks 4-5,7, devices 0,1,3" in text
    assert "recent events (5 of 5):" in text
    failure = next(line for line in lines if "failure" in line)
    assert "actor died" in failure and "rank=5" in failure and "node_id=b7c2b7c2" in failure
    lend = next(line for line in lines if " lend " in line)
    assert "train_devices=6 infer_devices=2" in lend


def test_harvest_ranks_are_marked_on_their_shared_devices():
    workers = _status()["workers"]
    workers[-1] = {**workers[-1], "share": 0.25}
    text = format_status(_status(workers=workers, num_harvest=1, num_spares=0))
    assert text.splitlines()[1] == "layout dp=3,tp=2 on 6 workers, 1 beside serving replicas"
    assert "ranks 4-5,7, devices 0,1,3(shared)" in text


def test_finished_job_shows_no_time_to_go_and_events_are_limited():
    text = format_status(_status(state="finished", step=300), num_events=2)
    assert "to go" not in text
    assert "recent events (2 of 5):" in text
    assert "failure" not in text and "recovered" in text and "lend" in text


def test_an_empty_early_status_still_renders():
    text = format_status({"name": "x", "state": "planning", "step": 0, "num_steps": 10, "layout": "",
                          "num_workers": 0, "num_spares": 0, "workers": [], "events": [], "steps_per_s": 0.0,
                          "goodput": None, "started_at": time.time(), "elapsed_s": 0.2})
    assert "job x: planning, step 0/10 (0%), elapsed 0.2s" in text
    assert "goodput n/a" in text and text.count("(none)") == 2


def test_recoveries_are_summarized_when_the_controller_reports_them():
    recoveries = [{"recovery_s": 5.4, "resumed_step": 61, "lost_steps": 0},
                  {"recovery_s": 1.25, "resumed_step": 90, "lost_steps": 1}]
    lines = format_status(_status(recoveries=recoveries)).splitlines()
    assert lines[3] == "2 recoveries, last took 1.2s (worst 5.4s), 1 step redone"
    assert "recover" not in format_status(_status(recoveries=[])).splitlines()[3]


def test_the_last_recoverys_phases_and_its_slowest_regroup_parts_are_shown():
    last = {"recovery_s": 0.37, "resumed_step": 25, "lost_steps": 1,
            "phases_s": {"detected": 0.103, "confirmed": 0.112, "decided": 0.181, "regrouped": 0.265,
                         "first_step_done": 0.365},
            "regroup_parts_s": {"join": 0.0155, "build_engine": 0.0265, "fetch_state": 0.0317, "load_state": 0.0059}}
    lines = format_status(_status(recoveries=[last])).splitlines()
    assert lines[4] == "  last recovery: detected 0.10s, decided 0.18s, regrouped 0.27s, next step done 0.36s"
    assert lines[5] == ("  its regroup, slowest member: join 0.02s, build_engine 0.03s, fetch_state 0.03s, "
                        "load_state 0.01s")


def test_event_line_carries_the_local_clock_time():
    event = {"time": time.mktime((2026, 1, 2, 13, 4, 5, 0, 0, -1)), "kind": "eviction", "reason": "slow"}
    assert format_event(event).startswith("13:04:05  eviction")


@pytest.mark.parametrize("numbers, text", [([], ""), ([3], "3"), ([0, 1, 2, 5, 7, 8], "0-2,5,7-8"),
                                           ([4, 2, 3], "2-4")])
def test_compress_ranges(numbers, text):
    assert compress_ranges(numbers) == text


@pytest.mark.parametrize("seconds, text", [(0.25, "0.2s"), (59.9, "59.9s"), (61, "1m01s"), (3725, "1h02m05s")])
def test_format_duration(seconds, text):
    assert format_duration(seconds) == text


def test_choose_run_picks_the_only_job_or_the_named_one():
    assert choose_run(["demo"], None) == "demo"
    assert choose_run(["a", "b"], "b") == "b"
    with pytest.raises(ValueError, match="choose one with --name"):
        choose_run(["a", "b"], None)
    with pytest.raises(ValueError, match="no baige-ray job is running"):
        choose_run([], None)
    with pytest.raises(ValueError, match="--name='c' is invalid"):
        choose_run(["a", "b"], "c")


def test_status_command_is_registered_and_checks_its_arguments(capsys):
    assert main(["status", "--events", "-1"]) == 2
    assert "--events=-1" in capsys.readouterr().err
