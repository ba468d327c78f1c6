"""`bench pd` checks its arguments and reports disaggregated over colocated per level (its runs are
measured by the bench itself, on Ray, not here)."""

import argparse

import pytest

from baige_ray.bench import pd as bench_pd
from baige_ray.bench.cli import BENCHMARK_MODULES


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    bench_pd.add_arguments(parser)
    return parser.parse_args(list(argv))


@pytest.mark.parametrize(("argv", "flag"), [(("--replicas", "1"), "--replicas"),
                                            (("--prefill-replicas", "2"), "--prefill-replicas"),
                                            (("--streams", "0"), "--streams"), (("--seconds", "0"), "--seconds"),
                                            (("--new-tokens", "0"), "--new-tokens")])
def test_invalid_arguments_name_the_flag(argv, flag):
    with pytest.raises(ValueError, match=flag):
        bench_pd.check_arguments(parse(*argv))


def test_ratios_and_summary_compare_the_systems_level_by_level():
    assert BENCHMARK_MODULES["pd"] == "baige_ray.bench.pd"
    bench_pd.check_arguments(parse())
    row = {"colocated": {"tokens_per_s": 200.0, "requests": 10, "ttft_p50_s": 0.02, "ttft_p99_s": 0.05,
                         "itl_p50_s": 0.01, "itl_p99_s": 0.03},
           "disaggregated": {"tokens_per_s": 150.0, "requests": 8, "ttft_p50_s": 0.03, "ttft_p99_s": 0.06,
                             "itl_p50_s": 0.005, "itl_p99_s": 0.02}}
    assert bench_pd.ratios(row) == {"throughput_ratio": 0.75, "ttft_p50_ratio": 1.5, "itl_p50_ratio": 0.5}
    result = {"model": "gpt", "replicas": 2, "prefill_replicas": 1, "decode_replicas": 1, "new_tokens": 32,
              "mean_prompt_tokens": 61.8, "levels": {"4": {**row, **bench_pd.ratios(row)}}, "same_greedy_tokens": True}
    summary = bench_pd.summarize(result)
    assert "1 prefill + 1 decode" in summary and "throughput 0.75x" in summary and "same greedy tokens: True" in summary
