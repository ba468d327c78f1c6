"""A persisted checkpoint damaged on disk is skipped with a record in the job's own event log, and the
one before it is restored (found by the soak: the skip was only a log warning, so nothing the job or its
operator reads said that a checkpoint had been lost). The soak's damage is what the checksum catches."""

import pytest

from baige_ray.api.elastic import ElasticConfig
from baige_ray.bench.soak_faults import damage_largest_file
from baige_ray.checkpoint.store import CheckpointError, verify_checkpoint, write_checkpoint
from baige_ray.elastic import state_sources
from baige_ray.elastic.state_sources import StateSources
from baige_ray.ops.events import EventLog
from tests.unit.fixtures.checkpoint_states import assert_states_equal, trained_state


def test_a_damaged_newest_checkpoint_is_recorded_as_skipped_and_the_older_one_restored(tmp_path, monkeypatch):
    older, newer = trained_state(seed=1), trained_state(seed=2)
    write_checkpoint(tmp_path / "checkpoints", 24, older, meta={})
    newest = write_checkpoint(tmp_path / "checkpoints", 49, newer, meta={})
    size = sum(p.stat().st_size for p in newest.iterdir())
    damaged = damage_largest_file(newest)
    assert sum(p.stat().st_size for p in newest.iterdir()) == size
    with pytest.raises(CheckpointError, match=f"{damaged.name} fails its SHA-256 check"):
        verify_checkpoint(newest)

    monkeypatch.setattr(state_sources.ray, "put", lambda value: value)  # no Ray here: the state itself
    events = EventLog(tmp_path / "events.jsonl")
    sources = StateSources(ElasticConfig(persist_every=25, persist_path=tmp_path / "checkpoints"), "run", events)
    step, (state,) = sources.persisted_state()
    assert step == 24
    assert_states_equal(state, older)
    skipped, restored = events.recent(2)
    assert skipped["reason"].startswith("skipped persisted step 49: ") and "SHA-256" in skipped["reason"]
    assert skipped["step"] == 49 and skipped["skipped"] == str(newest)
    assert restored["reason"] == "restored persisted step 24"


def test_the_soak_damages_the_checkpoint_committed_next_and_kills_every_worker_and_spare(tmp_path, monkeypatch):
    """A job on one node replicates its snapshots to a spare on the other: twice in a 30-minute soak the
    workers were killed, the spare's copy restored them, and the damaged checkpoint was never read. Every
    process that may hold the state goes (real processes here, a job's status describing them)."""
    import subprocess
    import threading

    from baige_ray.bench import soak_faults
    from baige_ray.bench.soak_schedule import ScheduledFault

    processes = [subprocess.Popen(["sleep", "60"]) for _ in range(3)]
    pids = [p.pid for p in processes]

    class Job:
        def status(self):
            return {"workers": [{"rank": r, "pid": pid} for r, pid in enumerate(pids[:2])],
                    "spares": [{"rank": None, "pid": pids[2]}, {"rank": None, "pid": None}]}  # one still starting

    monkeypatch.setattr(soak_faults, "run_shelves", lambda run: tmp_path / "shelves" / run)
    checkpoints = tmp_path / "checkpoints"
    write_checkpoint(checkpoints, 24, trained_state(seed=1), meta={})
    injector = soak_faults.FaultInjector(Job(), "run", "app", None, checkpoints, set(),
                                         checkpoints_on_own_volume=False)
    committing = threading.Timer(0.3, lambda: write_checkpoint(checkpoints, 49, trained_state(seed=2), meta={}))
    committing.start()
    try:
        outcome = injector.inject(ScheduledFault(at_s=0.0, kind="checkpoint_corrupt", pick=0))
        ended = [p.wait(timeout=5) for p in processes]
    finally:
        committing.join()
        for process in processes:
            process.kill()
    assert outcome["corrupted_step"] == 49 and outcome["pids"] == pids
    assert ended == [-9, -9, -9]  # SIGKILLed, the spare too
    with pytest.raises(CheckpointError):
        verify_checkpoint(checkpoints / "step-00000049")
