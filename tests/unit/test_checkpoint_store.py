import json
import logging

import pytest
import torch

from baige_ray.api.errors import CheckpointError
from baige_ray.checkpoint.files import sha256_file
from baige_ray.checkpoint.store import (
    COMMIT_MARKER,
    MANIFEST_FILE,
    META_FILE,
    MODEL_FILE,
    OPTIMIZER_FILE,
    checkpoint_dir_name,
    flatten_optimizer,
    list_checkpoints,
    load_checkpoint,
    load_latest_good,
    prune_checkpoints,
    unflatten_optimizer,
    verify_checkpoint,
    write_checkpoint,
)
from tests.unit.fixtures.checkpoint_states import assert_states_equal, flip_byte, trained_state

META = {"layout": "dp=1 tp=1 pp=1", "model_config": {"hidden": 16}}


def test_round_trip_is_bitwise_equal_and_keeps_meta(tmp_path):
    state = trained_state()
    path = write_checkpoint(tmp_path, 7, state, meta=META)
    assert path == tmp_path / "step-00000007"
    step, loaded, meta = load_checkpoint(path)
    assert step == 7 and meta == META
    assert_states_equal(state, loaded)
    assert loaded["optimizer"]["lm_head.weight"]["step"].dim() == 0


def test_manifest_records_size_and_hash_of_every_file(tmp_path):
    path = write_checkpoint(tmp_path, 3, trained_state(), meta=META)
    manifest = json.loads((path / MANIFEST_FILE).read_text())
    assert set(manifest["files"]) == {MODEL_FILE, OPTIMIZER_FILE, META_FILE}
    for name, record in manifest["files"].items():
        assert record == {"bytes": (path / name).stat().st_size, "sha256": sha256_file(path / name)}
    marker = json.loads((path / COMMIT_MARKER).read_text())
    assert marker["manifest_sha256"] == sha256_file(path / MANIFEST_FILE)
    assert json.loads((path / META_FILE).read_text())["step"] == 3
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")], "staging directory left behind"


def test_generic_optimizer_sections_and_views_of_one_buffer_persist(tmp_path):
    flat = torch.arange(30, dtype=torch.float32)
    state = {
        "model": {"w": flat[:20].view(4, 5), "b": flat[20:25], "half": torch.ones(3, dtype=torch.bfloat16)},
        "optimizer": {"w": {"momentum_buffer": flat[25:].clone()}, "b": {"momentum_buffer": torch.zeros(5)}},
    }
    _, loaded, _ = load_checkpoint(write_checkpoint(tmp_path, 0, state, meta={}))
    assert_states_equal(state, loaded)


def test_optimizer_keys_flatten_and_back():
    optimizer = {"blocks.0.up.weight": {"step": torch.tensor(2.0), "exp_avg": torch.ones(2)}}
    flat = flatten_optimizer(optimizer)
    assert set(flat) == {"blocks.0.up.weight/step", "blocks.0.up.weight/exp_avg"}
    assert unflatten_optimizer(flat) == optimizer
    with pytest.raises(TypeError, match="w/lr is a float"):
        flatten_optimizer({"w": {"lr": 0.1}})
    with pytest.raises(ValueError, match="contains '/'"):
        flatten_optimizer({"w": {"a/b": torch.ones(1)}})


def test_unserializable_meta_writes_nothing(tmp_path):
    with pytest.raises(TypeError):
        write_checkpoint(tmp_path, 1, trained_state(), meta={"bad": object()})
    assert list(tmp_path.iterdir()) == []


def test_list_checkpoints_shows_committed_only_oldest_first(tmp_path):
    state = trained_state()
    for step in (20, 5, 12):
        write_checkpoint(tmp_path, step, state, meta=META)
    (tmp_path / checkpoint_dir_name(12) / COMMIT_MARKER).unlink()
    (tmp_path / "step-notanumber").mkdir()
    assert list_checkpoints(tmp_path) == [(5, tmp_path / "step-00000005"), (20, tmp_path / "step-00000020")]
    assert list_checkpoints(tmp_path / "absent") == []


def test_rewriting_a_step_replaces_it(tmp_path):
    write_checkpoint(tmp_path, 4, trained_state(seed=0), meta={"run": 1})
    newer = trained_state(seed=1)
    write_checkpoint(tmp_path, 4, newer, meta={"run": 2})
    _, loaded, meta = load_checkpoint(tmp_path / checkpoint_dir_name(4))
    assert meta == {"run": 2}
    assert_states_equal(newer, loaded)
    assert [p.name for p in tmp_path.iterdir()] == ["step-00000004"]


@pytest.fixture
def two_checkpoints(tmp_path):
    """Good checkpoints at steps 10 and 20; tests damage step 20."""
    older, newer = trained_state(seed=0), trained_state(seed=1)
    write_checkpoint(tmp_path, 10, older, meta={"which": "older"})
    newest = write_checkpoint(tmp_path, 20, newer, meta={"which": "newer"})
    return tmp_path, newest, older


def test_flipped_byte_is_named_with_expected_and_actual_hash(two_checkpoints):
    _, newest, _ = two_checkpoints
    flip_byte(newest / MODEL_FILE)
    with pytest.raises(CheckpointError, match=r"model\.safetensors fails its SHA-256 check: expected [0-9a-f]{64}, got"):
        verify_checkpoint(newest)


def test_truncated_file_is_named_with_expected_and_actual_size(two_checkpoints):
    _, newest, _ = two_checkpoints
    optimizer_file = newest / OPTIMIZER_FILE
    size = optimizer_file.stat().st_size
    optimizer_file.write_bytes(optimizer_file.read_bytes()[:-64])
    with pytest.raises(CheckpointError, match=rf"optimizer\.safetensors holds {size - 64} bytes, expected {size}"):
        verify_checkpoint(newest)


def test_edited_manifest_is_caught_by_the_commit_marker(two_checkpoints):
    _, newest, _ = two_checkpoints
    manifest = json.loads((newest / MANIFEST_FILE).read_text())
    manifest["step"] = 99
    (newest / MANIFEST_FILE).write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match=r"manifest\.json fails its SHA-256 check"):
        verify_checkpoint(newest)


def test_missing_commit_marker_means_never_committed(two_checkpoints):
    _, newest, _ = two_checkpoints
    (newest / COMMIT_MARKER).unlink()
    with pytest.raises(CheckpointError, match="never committed"):
        load_checkpoint(newest)


@pytest.mark.parametrize("damage", ["flip", "truncate", "uncommit", "garble_marker", "delete_file"])
def test_load_latest_good_falls_back_to_the_previous_good_checkpoint(two_checkpoints, damage, caplog):
    root, newest, older = two_checkpoints
    if damage == "flip":
        flip_byte(newest / OPTIMIZER_FILE, 0.9)
    elif damage == "truncate":
        (newest / MODEL_FILE).write_bytes((newest / MODEL_FILE).read_bytes()[:100])
    elif damage == "uncommit":
        (newest / COMMIT_MARKER).unlink()
    elif damage == "garble_marker":
        (newest / COMMIT_MARKER).write_text("[1, 2")
    else:
        (newest / META_FILE).unlink()
    with caplog.at_level(logging.WARNING, logger="baige_ray.checkpoint.store"):
        skipped = []
        step, state, meta = load_latest_good(root, on_skip=lambda step, path, error: skipped.append((step, path)))
    assert step == 10 and meta == {"which": "older"}
    assert_states_equal(older, state)
    assert any("step 20" in record.getMessage() and str(newest) in record.getMessage() for record in caplog.records)
    assert skipped == [(20, newest)]


def test_load_latest_good_without_a_good_checkpoint_is_none(tmp_path):
    assert load_latest_good(tmp_path) is None
    path = write_checkpoint(tmp_path, 1, trained_state(), meta={})
    flip_byte(path / MODEL_FILE)
    assert load_latest_good(tmp_path) is None


def test_retention_keeps_the_newest_committed(tmp_path):
    state = trained_state()
    for step in range(1, 6):
        write_checkpoint(tmp_path, step, state, meta={}, keep_last=2)
    assert [step for step, _ in list_checkpoints(tmp_path)] == [4, 5]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-00000004", "step-00000005"]


def test_pruning_removes_unfinished_leftovers_older_than_the_newest(tmp_path):
    state = trained_state()
    write_checkpoint(tmp_path, 3, state, meta={})
    (tmp_path / checkpoint_dir_name(3) / COMMIT_MARKER).unlink()  # crashed before its commit
    (tmp_path / ".step-00000004.tmp-1-abcd").mkdir()  # crashed while writing
    write_checkpoint(tmp_path, 6, state, meta={})
    (tmp_path / ".step-00000009.tmp-1-abcd").mkdir()  # a newer write may still be in flight
    removed = prune_checkpoints(tmp_path, keep_last=3)
    assert sorted(p.name for p in removed) == [".step-00000004.tmp-1-abcd", "step-00000003"]
    assert sorted(p.name for p in tmp_path.iterdir()) == [".step-00000009.tmp-1-abcd", "step-00000006"]
    with pytest.raises(ValueError, match="keep_last=0"):
        prune_checkpoints(tmp_path, keep_last=0)
