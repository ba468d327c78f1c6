"""`bench longctx`'s serving part in quick form: arrivals on their schedule, every request answered in both
modes with the same greedy tokens, and the acceptance figure reported; its training part's search for the
longest sequence under a memory cap."""

import argparse
import math

from baige_ray.bench import longctx, longctx_training


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
    args = parser.parse_args(["--quick", "--part", "serving", "--duration-s", "1.0", "--short-interval-s", "0.1", "--long-interval-s", "0.5",
                              "--long-tokens", "256", "--answer-tokens", "3"])
    result = longctx.run(args)
    whole, chunked = result["serving"]["whole"], result["serving"]["chunked"]
    assert whole["short_requests"] == chunked["short_requests"] == 10
    assert whole["long_requests"] == chunked["long_requests"] == 2
    assert result["tokens_equal"] and math.isfinite(result["chunked_short_ttft_p99_speedup"])
    assert "training" not in result and "TTFT p99" in longctx.summarize(result)


def test_the_longest_sequence_under_a_cap_is_found_from_two_samples_and_checked_by_measure():
    measured = []

    def measure(length: int) -> float:  # 1,000 bytes plus 3 a token, but 200 more from 600 tokens on
        measured.append(length)
        return 1000 + 3 * length + (200 if length >= 600 else 0)

    samples = {256: measure(256), 512: measure(512)}
    # The straight line through the samples reaches the cap at 700 tokens, 640 in steps of 64; 640 measures
    # over it (3,120 bytes), 576 under, and the step after 576 is over again.
    assert longctx_training.longest_under(samples, cap=3100.0, step=64, measure=measure) == 576
    assert measured[2:] == [640, 576, 640]
