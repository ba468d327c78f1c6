import json

from baige_ray.elastic.step_log import StepLog, read_steps


def test_a_resumed_log_reads_back_the_history_and_a_redone_step_wins(tmp_path):
    path = tmp_path / "run" / "steps.jsonl"
    log = StepLog(path, resume=False)
    for step in range(3):
        log.append({"step": step, "loss": 1.0 - step / 10})
    log.keep_before(2)
    log.append({"step": 2, "loss": 0.5})  # the redo of step 2
    log.close()
    with path.open("a") as torn:
        torn.write('{"step": 3, "lo')
    resumed = StepLog(path, resume=True)
    assert [r["step"] for r in resumed.records] == [0, 1, 2]
    assert resumed.records[2]["loss"] == 0.5
    resumed.close()


def test_a_fresh_run_of_the_same_name_starts_an_empty_log(tmp_path):
    path = tmp_path / "steps.jsonl"
    path.write_text(json.dumps({"step": 0, "loss": 9.0}) + "\n")
    StepLog(path, resume=False).close()
    assert read_steps(path) == []


def test_memory_keeps_the_newest_records_and_the_file_every_step_not_forgotten(tmp_path):
    from baige_ray.elastic.step_log import RECENT_RECORDS

    path = tmp_path / "steps.jsonl"
    log = StepLog(path, resume=False)
    total = RECENT_RECORDS + 50
    for step in range(total):
        log.append({"step": step, "loss": float(step)})
    assert [r["step"] for r in log.records] == list(range(50, total))  # a long job's controller stays small
    log.keep_before(total - 2)  # the last two steps are to be done again; the run ends before they are
    log.close()
    assert [r["step"] for r in read_steps(path)] == list(range(total - 2))
    resumed = StepLog(path, resume=True)
    assert resumed.records[-1]["step"] == total - 3 and len(resumed.records) == RECENT_RECORDS
    assert len(resumed.all_records()) == total - 2
    resumed.close()
