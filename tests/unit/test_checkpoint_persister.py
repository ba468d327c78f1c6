import threading

import pytest

from baige_ray.checkpoint.persister import AsyncPersister
from baige_ray.checkpoint.store import MODEL_FILE, list_checkpoints, load_latest_good, write_checkpoint
from tests.unit.fixtures.checkpoint_states import assert_states_equal, flip_byte, trained_state


class GatedWrite:
    """The real `write_checkpoint`, held at a gate so a test controls when the disk 'finishes'."""

    def __init__(self):
        self.gate = threading.Event()
        self.entered = threading.Event()
        self.steps: list[int] = []

    def __call__(self, root, step, state, **kwargs):
        self.steps.append(step)
        self.entered.set()
        assert self.gate.wait(timeout=30), "test never opened the gate"
        return write_checkpoint(root, step, state, **kwargs)


@pytest.fixture
def state():
    return trained_state()


def test_submissions_faster_than_the_disk_coalesce_to_the_newest(tmp_path, state):
    write = GatedWrite()
    with AsyncPersister(tmp_path, keep_last=5, write=write) as persister:
        persister.submit(1, state, {})
        assert write.entered.wait(timeout=30)
        for step in (2, 3, 4):  # returns at once although the writer is stuck on step 1
            persister.submit(step, state, {})
        assert persister.num_coalesced == 2
        assert persister.last_persisted_step is None
        write.gate.set()
        assert persister.flush(timeout=30)
    assert write.steps == [1, 4]
    assert [step for step, _ in list_checkpoints(tmp_path)] == [1, 4]
    assert persister.last_persisted_step == 4 and persister.errors == []


def test_flush_waits_for_the_write_in_flight(tmp_path, state):
    write = GatedWrite()
    persister = AsyncPersister(tmp_path, write=write)
    persister.submit(3, state, {})
    assert write.entered.wait(timeout=30)
    assert persister.flush(timeout=0.05) is False
    write.gate.set()
    assert persister.flush(timeout=30) is True
    assert persister.last_persisted_step == 3
    assert persister.close(timeout=30)


def test_close_persists_what_is_waiting_then_refuses_more(tmp_path, state):
    write = GatedWrite()
    persister = AsyncPersister(tmp_path, write=write)
    persister.submit(1, state, {})
    assert write.entered.wait(timeout=30)
    persister.submit(2, state, {})
    write.gate.set()
    assert persister.close(timeout=30)
    assert [step for step, _ in list_checkpoints(tmp_path)] == [1, 2]
    with pytest.raises(RuntimeError, match="after close"):
        persister.submit(3, state, {})


def test_a_failed_write_is_recorded_and_the_next_one_still_persists(tmp_path, state):
    with AsyncPersister(tmp_path) as persister:
        persister.submit(2, state, {"unserializable": object()})
        assert persister.flush(timeout=30)
        persister.submit(3, state, {"fine": True})
        assert persister.flush(timeout=30)
    (error,) = persister.errors
    assert isinstance(error, TypeError)
    assert any("step 2" in note for note in error.__notes__)
    assert persister.last_persisted_step == 3
    assert [step for step, _ in list_checkpoints(tmp_path)] == [3]


def test_persisted_state_round_trips_bitwise_and_retention_applies(tmp_path):
    states = {step: trained_state(seed=step) for step in (1, 2, 3, 4)}
    with AsyncPersister(tmp_path, keep_last=2) as persister:
        for step, state in states.items():
            persister.submit(step, state, {"step_meta": step})
            assert persister.flush(timeout=30)
    assert [step for step, _ in list_checkpoints(tmp_path)] == [3, 4]
    step, loaded, meta = load_latest_good(tmp_path)
    assert step == 4 and meta == {"step_meta": 4}
    assert_states_equal(states[4], loaded)


def test_corrupting_the_newest_falls_back_to_the_previous_persisted_step(tmp_path):
    older, newer = trained_state(seed=1), trained_state(seed=2)
    with AsyncPersister(tmp_path) as persister:
        persister.submit(10, older, {})
        assert persister.flush(timeout=30)
        persister.submit(11, newer, {})
    flip_byte(tmp_path / "step-00000011" / MODEL_FILE, 0.99)
    step, loaded, _ = load_latest_good(tmp_path)
    assert step == 10
    assert_states_equal(older, loaded)


def test_keep_last_must_be_positive(tmp_path):
    with pytest.raises(ValueError, match="keep_last=0"):
        AsyncPersister(tmp_path, keep_last=0)


def test_every_write_done_or_failed_is_reported_to_the_listener(tmp_path, state):
    heard = []
    attempts = iter([OSError(28, "No space left on device"), None])

    def write(root, step, state, *, meta, keep_last):
        if (error := next(attempts)) is not None:
            raise error
        return root

    with AsyncPersister(tmp_path, write=write, on_written=lambda *args: heard.append(args)) as persister:
        persister.submit(24, state, {})
        assert persister.flush(timeout=30)
        persister.submit(49, state, {})
        assert persister.flush(timeout=30)
    (failed_step, error, _), (done_step, none, seconds) = heard
    assert (failed_step, done_step, none) == (24, 49, None) and "No space left" in str(error) and seconds >= 0
    assert persister.last_persisted_step == 49 and len(persister.errors) == 1
