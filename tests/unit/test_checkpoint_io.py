import json

import pytest
import torch

from baige_ray.api.errors import CheckpointError
from baige_ray.checkpoint.final import MANIFEST_FILE, WEIGHTS_FILE, load_model_state, save_model_checkpoint
from baige_ray.models.gpt import GPT, GPTConfig
from baige_ray.runtime.checkpoint_io import load_model

TINY = GPTConfig(seq_len=8, num_layers=1, num_heads=2, hidden=16)


@pytest.fixture
def saved(tmp_path):
    torch.manual_seed(0)
    model = GPT(TINY)
    save_model_checkpoint(tmp_path / "ckpt", model.state_dict(), model_config=TINY, step=12)
    return tmp_path / "ckpt", model


def test_roundtrip_restores_model(saved):
    directory, model = saved
    loaded = load_model(directory)
    assert loaded.config == TINY
    tokens = torch.randint(0, 256, (2, 8))
    torch.testing.assert_close(loaded(tokens), model.eval()(tokens))
    assert json.loads((directory / MANIFEST_FILE).read_text())["step"] == 12


def test_truncated_weights_are_detected(saved):
    directory, _ = saved
    weights = directory / WEIGHTS_FILE
    weights.write_bytes(weights.read_bytes()[:-100])
    with pytest.raises(CheckpointError, match="truncated"):
        load_model_state(directory)


def test_corrupted_weights_are_detected(saved):
    directory, _ = saved
    weights = directory / WEIGHTS_FILE
    data = bytearray(weights.read_bytes())
    data[len(data) // 2] ^= 0xFF
    weights.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="SHA-256"):
        load_model_state(directory)


def test_uncommitted_checkpoint_is_rejected(saved):
    directory, _ = saved
    (directory / MANIFEST_FILE).unlink()
    with pytest.raises(CheckpointError, match="never committed"):
        load_model(directory)


def test_garbled_manifest_is_rejected(saved):
    directory, _ = saved
    (directory / MANIFEST_FILE).write_text("{not json")
    with pytest.raises(CheckpointError, match="not valid JSON"):
        load_model(directory)


def test_arbitrary_pickles_are_refused(tmp_path, saved):
    directory, _ = saved

    class Payload:
        def __reduce__(self):
            return (print, ("this must never run",))

    weights = directory / WEIGHTS_FILE
    torch.save({"x": Payload()}, weights)
    manifest = json.loads((directory / MANIFEST_FILE).read_text())
    import hashlib

    manifest.update(weights_sha256=hashlib.sha256(weights.read_bytes()).hexdigest(), weights_bytes=weights.stat().st_size)
    (directory / MANIFEST_FILE).write_text(json.dumps(manifest))
    with pytest.raises(Exception, match="Weights only load failed|Unsupported"):
        load_model_state(directory)
