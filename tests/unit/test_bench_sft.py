"""bench sft's pieces without Ray: TRL is handed exactly the tokens, trained targets and conversation
boundaries baige-ray trains, and the summary names the acceptance figures."""

import argparse

import pytest
import torch


@pytest.fixture(scope="module")
def bench_data(tmp_path_factory):
    from baige_ray.bench import sft

    parser = argparse.ArgumentParser()
    sft.add_arguments(parser)
    args = parser.parse_args(["--steps", "2", "--conversations", "60", "--seq-len", "128"])
    work = tmp_path_factory.mktemp("bench-sft")
    model_dir = sft.make_chat_model(work, hidden=64, layers=1)
    return args, sft.build_conversations(work, model_dir, args), model_dir


def test_trl_rows_are_the_sequences_baige_ray_trains_in_its_order(bench_data):
    from baige_ray.bench.sft import trl_rows

    args, data, _ = bench_data
    rows = trl_rows(data, args)
    assert len(rows) == args.steps * args.global_batch_size
    inputs, targets = data.batch(range(len(rows)), 0)
    positions = data.positions(range(len(rows)), 0)
    for row, row_inputs, row_targets, row_positions in zip(rows, inputs, targets, positions):
        tokens, labels = torch.tensor(row["input_ids"]), torch.tensor(row["labels"])
        assert torch.equal(tokens[:-1], row_inputs) and torch.equal(labels[1:], row_targets)  # transformers shifts
        assert sum(row["seq_lengths"]) == args.seq_len + 1
        starts = torch.cumsum(torch.tensor([0, *row["seq_lengths"][:-1]]), 0)
        assert torch.equal(torch.nonzero(row_positions == 0).flatten(), starts[starts < args.seq_len])


def test_the_summary_reports_the_acceptance_figures():
    from baige_ray.bench.sft import _figures, summarize, summary

    class Data:
        padding_fraction = 0.05

    ours = _figures([2.0, 1.5], [3.0, 1.0], [100, 120], 1.5)
    assert ours["trained_tokens_per_s"] == 120.0
    runs = {"full_1": ours, "lora_1": {**ours, "peak_memory_gb": 1.2}, "trl_full": _figures([2.0, 1.53], [2, 2], [100, 120], None),
            "trl_lora": _figures([2.0, 1.5], [2, 1.2], [100, 120], None)}
    result = summary(runs, Data(), steps_lost=1, adapter_to_serving_s=0.25)
    assert result["full_tokens_per_s_vs_trl"] == 2.0 and result["lora_tokens_per_s_vs_trl"] == 1.2
    assert result["loss_max_rel_diff_vs_trl"] == pytest.approx(0.03 / 1.53, abs=1e-6)
    assert result["lora_peak_memory_vs_full"] == 0.8 and result["steps_lost"] == 1
    assert result["adapter_to_serving_s"] == 0.25 and "steps_lost: 1" in summarize(result)
    assert "adapter_to_serving_s: 0.25" in summarize(result)


def test_trl_in_two_processes_trains_each_step_on_the_steps_sequences(bench_data, tmp_path):
    """The peer of two workers: SFTTrainer under torchrun, its micro-batches dealt out by accelerate, still
    trains step s on step s's sequences: the same losses as in one process."""
    from baige_ray.bench.sft import trl_rows
    from baige_ray.bench.sft_trl import run_trl

    args, data, model_dir = bench_data
    settings = dict(steps=args.steps, global_batch_size=args.global_batch_size, micro_batch_size=args.micro_batch_size,
                    learning_rate=args.learning_rate, lora_rank=args.lora_rank)
    runs = [run_trl(tmp_path, model_dir, trl_rows(data, args), settings, processes=processes, adapter=False)
            for processes in (1, 2)]
    assert len(runs[0]["losses"]) == args.steps and runs[1]["peak_memory_gb"] > 0
    assert runs[1]["losses"] == pytest.approx(runs[0]["losses"], rel=1e-4)
