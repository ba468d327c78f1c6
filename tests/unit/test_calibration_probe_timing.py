"""The calibration probes' timing (runtime/calibration_probes.py): what runs untimed before each call stays
out of the seconds per call, also when a single call fills the window."""

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
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    process = context.Process(target=one_rank_timing, args=(port, results), daemon=True)
    process.start()
    try:
        seconds = results.get(timeout=60)
    finally:
        process.kill()
    assert RUN_S <= seconds < RUN_S + 0.05, f"{seconds:.3f}s per call: the untimed prepare ({PREPARE_S}s) was counted"
