import argparse

import pytest
import torch

from baige_ray.bench import cli
from baige_ray.bench.checkpoint import (
    PLAIN,
    SNAPSHOT,
    _write_plain_file,
    add_arguments,
    checkpoint_result,
    classify_steps,
    snapshot_schedule,
)
from baige_ray.models.gpt import GPT, GPTConfig


def test_schedule_is_warmup_then_alternating_blocks():
    assert snapshot_schedule(warmup=2, block=3, cycles=2) == [True, True] + ([False] * 3 + [True] * 3) * 2
    with pytest.raises(ValueError, match="block=1"):
        snapshot_schedule(warmup=1, block=1, cycles=1)


def test_transitions_and_warmup_are_left_out():
    schedule = snapshot_schedule(warmup=2, block=3, cycles=1)  # T T | F F F | T T T
    kinds = classify_steps(schedule, warmup=2)
    # Step 2 still has step 1's copy beside it; step 5 starts a copy with none beside it.
    assert kinds == [None, None, None, PLAIN, PLAIN, None, SNAPSHOT, SNAPSHOT]


def test_result_arithmetic():
    kinds = [None, PLAIN, PLAIN, PLAIN, None, SNAPSHOT, SNAPSHOT, SNAPSHOT]
    step_s = [9.0, 1.0, 1.2, 1.1, 5.0, 1.15, 1.2, 1.1]
    fence = [0.0, 0.0, 0.0, 0.0, 0.0, 0.01, 0.03, 0.02]
    result = checkpoint_result(params=100, kinds=kinds, step_s=step_s, fence_wait_s=fence,
                               state_bytes=3_000_000_000, persist_s=4.0, file_write_s=2.0)
    assert result["params"] == 100
    assert result["step_s"] == pytest.approx(1.1)
    assert result["snapshot_step_s"] == pytest.approx(1.15)
    assert result["stall_s"] == pytest.approx(0.05)
    assert result["stall_frac"] == pytest.approx(0.05 / 1.1, abs=1e-4)
    assert result["fence_wait_s"] == pytest.approx(0.02)
    assert result["step_min_s"] == pytest.approx(1.0)
    assert result["stall_min_s"] == pytest.approx(0.1)
    assert result["persist_gbps"] == pytest.approx(0.75)
    assert result["file_write_gbps"] == pytest.approx(1.5)
    assert result["persist_vs_file"] == pytest.approx(0.5)
    assert (result["num_plain_steps"], result["num_snapshot_steps"]) == (3, 3)


def test_a_snapshot_step_faster_than_plain_is_no_negative_stall():
    result = checkpoint_result(params=1, kinds=[PLAIN, SNAPSHOT], step_s=[1.0, 0.9], fence_wait_s=[0, 0],
                               state_bytes=1, persist_s=1, file_write_s=1)
    assert result["stall_s"] == 0.0 and result["snapshot_step_s"] == pytest.approx(0.9)


def test_result_needs_both_kinds_of_step_and_positive_write_times():
    with pytest.raises(ValueError, match="plain and snapshot"):
        checkpoint_result(params=1, kinds=[PLAIN], step_s=[1.0], fence_wait_s=[0.0],
                          state_bytes=1, persist_s=1, file_write_s=1)
    with pytest.raises(ValueError, match="positive"):
        checkpoint_result(params=1, kinds=[PLAIN, SNAPSHOT], step_s=[1, 1], fence_wait_s=[0, 0],
                          state_bytes=1, persist_s=0, file_write_s=1)


def test_default_model_has_about_100m_parameters():
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args([])
    config = GPTConfig(hidden=args.hidden, num_layers=args.num_layers, num_heads=args.num_heads, seq_len=args.seq_len)
    with torch.device("meta"):
        params = sum(p.numel() for p in GPT(config).parameters())
    assert params == 99_723_264


def test_plain_file_holds_exactly_the_tensor_bytes(tmp_path):
    tensors = [torch.arange(10, dtype=torch.float32), torch.ones(3, dtype=torch.int64), torch.tensor(2.0)]
    _write_plain_file(tmp_path / "plain.bin", tensors)
    assert (tmp_path / "plain.bin").read_bytes() == b"".join(t.numpy().tobytes() for t in tensors)


def test_checkpoint_is_registered():
    assert cli.BENCHMARK_MODULES["checkpoint"] == "baige_ray.bench.checkpoint"
