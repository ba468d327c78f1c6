"""`bench serve` runs both engines at each level and reports throughput and latency percentiles."""

import argparse

import torch

from baige_ray.bench import serve as bench_serve


def test_a_short_run_reports_every_level_and_system():
    parser = argparse.ArgumentParser()
    bench_serve.add_arguments(parser)
    args = parser.parse_args(["--streams", "1", "3", "--seconds", "0.3", "--new-tokens", "4"])
    threads = torch.get_num_threads()
    try:
        result = bench_serve.run(args)
    finally:
        torch.set_num_threads(threads)
    assert set(result["levels"]) == {"1", "3"}
    for row in result["levels"].values():
        assert row["engine"]["tokens_per_s"] > 0 and row["sampler"]["tokens_per_s"] > 0
        assert row["engine"]["ttft_p50_s"] <= row["engine"]["ttft_p99_s"]
        assert row["engine"]["itl_p50_s"] is not None and row["sampler"]["itl_p50_s"] is None  # the sampler does not stream
        assert row["engine_vs_sampler"] > 0
    assert "tok/s" in bench_serve.summarize(result)
