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
