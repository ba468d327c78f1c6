"""The soak's full checkpoint disk: a tmpfs of its own, filled to the last byte, then freed."""

from __future__ import annotations

import errno

import pytest

from baige_ray.bench.soak_faults import FILLER_NAME, checkpoint_volume, fill_volume


def test_a_filled_checkpoint_volume_refuses_writes_until_the_filler_is_gone(tmp_path):
    with checkpoint_volume(tmp_path / "checkpoints") as mounted:
        if not mounted:
            pytest.skip("mounting a tmpfs needs root here")
        filler = tmp_path / "checkpoints" / FILLER_NAME
        assert fill_volume(filler) > 0
        with pytest.raises(OSError) as refused:
            (tmp_path / "checkpoints" / "model.safetensors").write_bytes(bytes(4096))
        assert refused.value.errno == errno.ENOSPC
        filler.unlink()
        (tmp_path / "checkpoints" / "model.safetensors").write_bytes(bytes(4096))
    assert not (tmp_path / "checkpoints" / "model.safetensors").exists()  # it was on the tmpfs, now unmounted
