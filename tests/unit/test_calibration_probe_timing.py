"""The calibration probes' timing (runtime/calibration_probes.py): what runs untimed before each call stays
out of the seconds per call, also when a single call fills the window; a shape timed in rounds is the
median round, also when its call fills a round alone."""

from __future__ import annotations

import multiprocessing
import time

PREPARE_S, RUN_S = 0.2, 0.01


def one_rank_timing(port: int, results) -> None:
    import torch.distributed as dist

    from baige_ray.runtime.calibration_probes import _seconds_per_call

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    # The window is shorter than prepare + run: the one call timed to count the calls is the answer.
    seconds = _seconds_per_call(lambda: time.sleep(RUN_S), 0.05, "cpu", collective=True,
                                prepare=lambda: time.sleep(PREPARE_S))
    dist.destroy_process_group()
    results.put(seconds)


def test_a_collective_probe_whose_call_fills_the_window_leaves_its_prepare_out():
    seconds = _in_one_rank(one_rank_timing)
    assert RUN_S <= seconds < RUN_S + 0.05, f"{seconds:.3f}s per call: the untimed prepare ({PREPARE_S}s) was counted"


def rounds_timing(port: int, results) -> None:
    import torch.distributed as dist

    from baige_ray.runtime.calibration_probes import _in_rounds

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    # Rounds of 0.05 s: a short run, whose fourth timed call (in the first or second round) is slow; a long
    # one, whose call fills a round alone and whose second timed call is slow.
    short_calls, long_calls = [], []

    def short() -> None:
        short_calls.append(None)
        time.sleep(0.0 if len(short_calls) == 1 else 0.15 if len(short_calls) == 5 else 0.02)

    def long() -> None:
        long_calls.append(None)
        time.sleep(0.5 if len(long_calls) == 3 else 0.2)

    seconds = _in_rounds([short, long], 3, 0.15, "cpu", collective=False)
    dist.destroy_process_group()
    results.put((seconds, len(long_calls)))


def _in_one_rank(target):
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    process = context.Process(target=target, args=(port, results), daemon=True)
    process.start()
    try:
        return results.get(timeout=60)
    finally:
        process.kill()


def test_a_shape_timed_in_rounds_is_the_median_round_and_a_long_call_is_timed_once_a_round():
    (short_s, long_s), long_calls = _in_one_rank(rounds_timing)
    assert 0.015 <= short_s < 0.05, f"{short_s:.3f}s per call: the round with the slow call (0.15 s) was not left out"
    assert long_calls == 4, f"{long_calls} calls of the long run: expected its warm-up and one a round"
    assert 0.2 <= long_s < 0.3, f"{long_s:.3f}s per call of the long run: its slow call (0.5 s) was not left out"
