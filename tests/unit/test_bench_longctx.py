"""`bench longctx`'s serving part in quick form: arrivals on their schedule, every request answered in both
modes with the same greedy tokens, and the acceptance figure reported."""

import argparse
import math

from baige_ray.bench import longctx


def test_the_schedule_interleaves_long_prompts_with_short_requests():
    arrivals = longctx.schedule(seed=0, duration_s=2.0, short_interval_s=0.5, long_interval_s=1.0, short_tokens=3,
                                long_tokens=9, vocab=50)
    assert [(a.at_s, a.long, len(a.prompt)) for a in arrivals] == [
        (0.0, False, 3), (0.5, False, 3), (0.5, True, 9), (1.0, False, 3), (1.5, False, 3), (1.5, True, 9)]
    assert arrivals == longctx.schedule(seed=0, duration_s=2.0, short_interval_s=0.5, long_interval_s=1.0,
                                        short_tokens=3, long_tokens=9, vocab=50)


def test_a_quick_run_answers_every_request_in_both_modes_with_the_same_tokens():
    parser = argparse.ArgumentParser()
    longctx.add_arguments(parser)
    args = parser.parse_args(["--quick", "--duration-s", "1.0", "--short-interval-s", "0.1", "--long-interval-s", "0.5",
                              "--long-tokens", "256", "--answer-tokens", "3"])
    result = longctx.run(args)
    whole, chunked = result["serving"]["whole"], result["serving"]["chunked"]
    assert whole["short_requests"] == chunked["short_requests"] == 10
    assert whole["long_requests"] == chunked["long_requests"] == 2
    assert result["tokens_equal"] and math.isfinite(result["chunked_short_ttft_p99_speedup"])
    assert "not built" in result["training"] and "TTFT p99" in longctx.summarize(result)
