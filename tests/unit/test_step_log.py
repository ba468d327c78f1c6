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
