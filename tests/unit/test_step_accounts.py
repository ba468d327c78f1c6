"""The controller's step bookkeeping: the hang deadline, the redo log and the straggler evidence."""

import math

import pytest

from baige_ray.api.elastic import ElasticConfig
from baige_ray.elastic.accounts import StepAccounts
from baige_ray.elastic.step_log import read_steps


def _report(step: int, compute_s: float = 1.0) -> dict:
    return {"step": step, "group_loss": 2.0 - step / 10, "learning_rate": 1e-3, "group_tokens": 64, "tokens": 32,
            "snapshot_stall_s": 0.001, "compute_s": compute_s}


@pytest.fixture
def accounts(tmp_path):
    accounts = StepAccounts("job", ElasticConfig(first_steps_timeout_s=300.0, collective_timeout_floor_s=5.0,
                                                 collective_timeout_factor=10.0))
    accounts.open(tmp_path / "steps.jsonl", resume=False)
    return accounts


def _record(accounts: StepAccounts, step: int, seconds: float, compute=(1.0, 1.0)) -> None:
    reports = [_report(step, c) for c in compute]
    accounts.record(step, reports, seconds, places=[("node", 0), ("node", 1)], stages=[0, 0])


def test_the_deadline_is_the_first_steps_timeout_until_a_generation_has_warm_step_times(accounts):
    assert accounts.deadline_s() == 300.0
    _record(accounts, 0, 2.0)
    _record(accounts, 1, 2.0)
    assert accounts.warm and accounts.deadline_s() == 20.0  # 10x the median step
    accounts.new_generation(num_parameters=1000)
    assert not accounts.warm and accounts.deadline_s() == 300.0  # new engine, new workers: no bound yet


def test_a_step_whose_result_died_with_a_worker_is_logged_from_a_survivor_and_redone_steps_are_forgotten(accounts, tmp_path):
    _record(accounts, 0, 1.0)
    accounts.record_unreported([None, _report(1)], 1)
    accounts.record_unreported([None, None], 2)  # nobody reported step 2: nothing to log
    assert [r["step"] for r in accounts.records] == [0, 1] and accounts.records[1]["partial"]
    assert math.isnan(accounts.records[1]["step_time_s"])
    assert accounts.unlogged_steps(4) == [2, 3]
    accounts.log.keep_before(1)
    _record(accounts, 1, 1.5)
    accounts.close()
    assert [r["step_time_s"] for r in read_steps(tmp_path / "steps.jsonl")] == [1.0, 1.5]


def test_straggler_evidence_is_per_rank_compute_time_past_the_warm_up_and_is_forgotten_after_an_eviction(accounts):
    for step in range(5):
        _record(accounts, step, 1.0, compute=(1.0, 3.0 + step))
    # The first two steps of a generation build caches: they are no evidence of a chip's pace.
    assert accounts.compute_history == [(1.0, 5.0), (1.0, 6.0), (1.0, 7.0)] and accounts.recent_step_s(3) == 1.0
    accounts.forget_compute_times()
    assert accounts.compute_history == [] and accounts.goodput() > 0
    _record(accounts, 5, 1.0, compute=(1.0, 3.0))
    accounts.new_generation(num_parameters=10)  # a regroup: ranks may be other workers now
    assert accounts.compute_history == []


def test_straggler_evidence_divides_each_ranks_compute_by_its_expected_load(accounts):
    """A rank holding two micro-batches where its peer holds one takes twice as long and is as fast."""
    accounts.new_generation(num_parameters=10, rank_loads=(4 / 3, 2 / 3))
    for step in range(4):
        _record(accounts, step, 1.0, compute=(2.0, 1.0))
    assert accounts.compute_history == [(1.5, 1.5), (1.5, 1.5)]
    assert [m["compute_s"] for m in read_steps(accounts.log.path)][-1] == [2.0, 1.0]  # the log keeps seconds
