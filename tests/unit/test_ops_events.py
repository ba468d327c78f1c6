import json
import threading
import time

import numpy as np
import pytest

from baige_ray.ops.events import EVENT_KINDS, EventLog, read_events


def test_record_writes_one_flushed_json_line_per_event(tmp_path):
    path = tmp_path / "run" / "events.jsonl"
    log = EventLog(path)
    before = time.time()
    event = log.record("resize", "lend to inference", train_devices=6, infer_devices=2)
    # Flushed: readable before close, from another file handle.
    lines = path.read_text().splitlines()
    assert len(lines) == 1
    assert json.loads(lines[0]) == event
    assert event["kind"] == "resize" and event["reason"] == "lend to inference"
    assert event["train_devices"] == 6 and event["infer_devices"] == 2
    assert before <= event["time"] <= time.time()
    log.close()


def test_recent_returns_the_newest_events_oldest_first_and_keeps_a_bounded_ring():
    log = EventLog(None, keep=5)
    for step in range(8):
        log.record("checkpoint", f"step {step}", step=step)
    assert [e["step"] for e in log.recent(3)] == [5, 6, 7]
    assert [e["step"] for e in log.recent(100)] == [3, 4, 5, 6, 7]
    assert log.recent(0) == []


def test_read_events_skips_a_truncated_last_line(tmp_path):
    path = tmp_path / "events.jsonl"
    with EventLog(path) as log:
        log.record("start", "8 workers up")
        log.record("failure", "actor died", rank=2, node_id="abc")
    with path.open("a") as file:
        file.write('{"time": 1.0, "kind": "fin')  # crash mid-write
    events = read_events(path)
    assert [e["kind"] for e in events] == ["start", "failure"]


def test_read_events_rejects_a_corrupt_line_in_the_middle(tmp_path):
    path = tmp_path / "events.jsonl"
    path.write_text('{"kind": "start"}\nnot json\n{"kind": "finished"}\n')
    with pytest.raises(ValueError, match="line 2"):
        read_events(path)


def test_reopening_cuts_a_partial_line_and_refills_recent_from_the_file(tmp_path):
    path = tmp_path / "events.jsonl"
    with EventLog(path) as log:
        log.record("plan", "dp=4 tp=2")
        log.record("start", "8 workers")
    with path.open("a") as file:
        file.write('{"time": 2.0, "kin')
    with EventLog(path, keep=10) as restarted:
        assert [e["kind"] for e in restarted.recent()] == ["plan", "start"]
        restarted.record("controller_restart", "controller actor restarted")
    assert [e["kind"] for e in read_events(path)] == ["plan", "start", "controller_restart"]


def test_concurrent_records_never_interleave(tmp_path):
    path = tmp_path / "events.jsonl"
    log = EventLog(path, keep=1000)

    def write(thread: int) -> None:
        for i in range(100):
            log.record("straggler", "x" * 500, thread=thread, i=i)

    threads = [threading.Thread(target=write, args=(t,)) for t in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    log.close()
    events = read_events(path)
    assert len(events) == 400
    assert sorted((e["thread"], e["i"]) for e in events) == [(t, i) for t in range(4) for i in range(100)]
    assert len(log.recent(1000)) == 400


def test_numpy_values_are_written_as_plain_json():
    log = EventLog(None)
    event = log.record("lend", "queue rising", train_devices=np.int64(4), infer_devices=np.int32(4),
                       ranks=np.arange(3), speed=np.float32(0.5))
    assert event["train_devices"] == 4 and type(event["train_devices"]) is int
    assert event["ranks"] == [0, 1, 2] and event["speed"] == 0.5


@pytest.mark.parametrize("kind, fields, message", [
    ("resise", {}, "kind='resise'"),
    ("resize", {}, "train_devices"),
    ("lend", {"train_devices": 4}, "infer_devices"),
    ("failure", {"rank": 1}, "node_id"),
    ("lend", {"train_devices": -1, "infer_devices": 2}, "train_devices=-1"),
    ("reclaim", {"train_devices": 2.5, "infer_devices": 2}, "train_devices=2.5"),
    ("start", {"time": 3.0}, "set by the log"),
])
def test_bad_events_are_rejected_naming_the_problem(kind, fields, message):
    with pytest.raises(ValueError, match=message):
        EventLog(None).record(kind, "why", **fields)


def test_every_documented_kind_is_accepted():
    log = EventLog(None)
    extra = {"resize": dict(train_devices=1), "lend": dict(train_devices=1, infer_devices=1),
             "reclaim": dict(train_devices=2, infer_devices=0), "unharvest": dict(train_devices=2, infer_devices=1),
             "failure": dict(rank=0, node_id="n")}
    for kind in EVENT_KINDS:
        log.record(kind, "reason", **extra.get(kind, {}))
    assert [e["kind"] for e in log.recent(len(EVENT_KINDS))] == list(EVENT_KINDS)


def test_keep_must_be_positive():
    with pytest.raises(ValueError, match="keep=0"):
        EventLog(None, keep=0)
