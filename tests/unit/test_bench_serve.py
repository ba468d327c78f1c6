"""`bench serve` runs every system at each level and reports throughput and latency percentiles;
vLLM's part is skipped with a reason wherever it cannot run (its own runs are measured by the bench, not here)."""

import argparse
import threading

import pytest
import torch

from baige_ray.bench import serve as bench_serve
from baige_ray.bench import serve_vllm


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    bench_serve.add_arguments(parser)
    return parser.parse_args(list(argv))


def test_a_short_run_reports_every_level_and_system():
    # vLLM runs in its own process in tests/ray/test_bench_serve_vllm.py: it keeps process-wide state.
    args = parse("--streams", "1", "3", "--seconds", "0.3", "--new-tokens", "4", "--systems", "builtin", "sampler")
    threads = torch.get_num_threads()
    try:
        result = bench_serve.run(args)
    finally:
        torch.set_num_threads(threads)
    assert set(result["levels"]) == {"1", "3"}
    for row in result["levels"].values():
        assert row["builtin"]["tokens_per_s"] > 0 and row["sampler"]["tokens_per_s"] > 0
        assert row["builtin"]["ttft_p50_s"] <= row["builtin"]["ttft_p99_s"]
        assert row["builtin"]["itl_p50_s"] is not None and row["sampler"]["itl_p50_s"] is None  # the sampler does not stream
        assert row["builtin_vs_sampler"] > 0 and "vllm" not in row
    assert "vllm_skipped" not in result and "handoff" not in result  # not asked for
    summary = bench_serve.summarize(result)
    assert "tok/s" in summary and "builtin/sampler" in summary


def test_every_system_runs_by_default_and_vllm_can_be_left_out():
    assert parse().systems == ["builtin", "vllm", "sampler"]
    assert parse("--systems", "builtin", "sampler").systems == ["builtin", "sampler"]
    with pytest.raises(SystemExit):
        parse("--systems", "engine")


@pytest.mark.parametrize(("argv", "flag"), [(("--streams", "0"), "--streams"), (("--seconds", "0"), "--seconds"),
                                            (("--new-tokens", "0"), "--new-tokens")])
def test_invalid_arguments_name_the_flag(argv, flag):
    with pytest.raises(ValueError, match=flag):
        bench_serve.check_arguments(parse(*argv))


def test_ratios_cover_the_pairs_a_level_ran():
    row = {"builtin": {"tokens_per_s": 300.0}, "vllm": {"tokens_per_s": 600.0}, "sampler": {"tokens_per_s": 100.0}}
    assert bench_serve.ratios(row) == {"builtin_vs_sampler": 3.0, "vllm_vs_sampler": 6.0, "vllm_vs_builtin": 2.0}
    assert bench_serve.ratios({"builtin": row["builtin"]}) == {}


def test_handoff_summary_shape():
    summary = serve_vllm.handoff_summary([0.03, 0.01, 0.02], 0.05, 2.95, checkpoint_bytes=3 * 2**20,
                                         same_tokens=True)
    assert summary == {"reload_in_memory_s": 0.02, "checkpoint_write_s": 0.05, "engine_from_checkpoint_s": 2.95,
                       "restart_s": 3.0, "restart_vs_reload": 150.0, "checkpoint_mb": 3.0,
                       "same_greedy_tokens": True}
    with pytest.raises(ValueError, match="reloads_s"):
        serve_vllm.handoff_summary([], 0.05, 2.95, checkpoint_bytes=1, same_tokens=True)


def test_a_failing_engine_thread_ends_the_level_with_its_error_instead_of_a_hang():
    class Broken:  # vLLM's CPU attention raised on the engine's thread like this, and clients waited forever
        def __init__(self):
            self.sinks = []

        def submit(self, prompt, params, on_event):
            self.sinks.append(on_event)

        def step(self):
            if self.sinks:
                raise RuntimeError("check failed: thread_num (2 vs. 1)")
            return False

        def wait_for_work(self, timeout_s):
            threading.Event().wait(timeout_s)

    with pytest.raises(RuntimeError, match="thread_num") as caught:
        bench_serve._run_engine(Broken(), [[1, 2, 3]], streams=3, seconds=30.0, new_tokens=4)
    assert "engine's thread failed" in str(caught.value)
