import json

import pytest
import torch
import torch.distributed as dist

from baige_ray.bench.torchrun_ddp import DDPSettings, train_ddp

TINY = {"num_layers": 2, "hidden": 32, "num_heads": 2, "seq_len": 16}


def test_settings_round_trip_through_json():
    settings = DDPSettings(model=TINY, num_steps=3, global_batch_size=8, seed=4)
    assert DDPSettings.from_json(settings.to_json()) == settings
    assert json.loads(settings.to_json())["model"] == TINY


def test_plain_ddp_loop_matches_the_single_process_engine(tmp_path):
    """One-rank gloo group: the baseline's losses equal fit's engine on the same job (same mathematics)."""
    from baige_ray.api.configs import TrainConfig
    from baige_ray.engines.factory import build_engine
    from baige_ray.engines.train_job import TrainJob
    from baige_ray.models.corpus import CorpusConfig
    from baige_ray.models.gpt import GPTConfig
    from baige_ray.parallel.layout import ParallelLayout

    settings = DDPSettings(model=TINY, num_steps=3, global_batch_size=4, corpus_max_bytes=1 << 20)
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    threads = torch.get_num_threads()  # train_ddp sets one thread, as in the benchmark
    try:
        losses: list[float] = []
        times = train_ddp(settings, lambda step, seconds, loss: losses.append(loss))
    finally:
        dist.destroy_process_group()
        torch.set_num_threads(threads)
    assert len(times) == 3 and all(t > 0 for t in times)
    job = TrainJob(
        model=GPTConfig(**TINY),
        train=TrainConfig(num_steps=3, global_batch_size=4),
        data=CorpusConfig(max_bytes=1 << 20),
    )
    engine = build_engine(job, ParallelLayout(), 0, device="cpu")
    expected = [engine.train_step(step)["loss"] for step in range(3)]
    assert losses == pytest.approx(expected, rel=1e-5)


def test_round_ratios_compare_each_round_after_its_warm_up():
    from baige_ray.bench.overhead import round_ratios

    times = {"torchrun": [[9.0, 1.0, 1.0], [9.0, 2.0, 2.0]], "baige": [[9.0, 1.1, 1.1], [9.0, 2.0, 2.0]]}
    assert round_ratios(times, warmup=1) == [{"vs_torchrun": 1.1}, {"vs_torchrun": 1.0}]
    assert round_ratios({"torchrun": times["torchrun"]}, warmup=1) == []


def test_ray_session_slowdown_compares_torchrun_beside_ray_with_torchrun_alone_round_by_round():
    from baige_ray.bench.overhead import ray_session_slowdown

    times = {"torchrun": [[9.0, 1.0, 1.0], [9.0, 2.0, 2.0]],
             "torchrun_beside_ray": [[9.0, 1.21, 1.21], [9.0, 2.0, 2.0]], "baige": [[9.0, 1.0, 1.0]] * 2}
    assert ray_session_slowdown(times, warmup=1) == pytest.approx(1.1)
    assert ray_session_slowdown({"torchrun": times["torchrun"], "baige": times["baige"]}, warmup=1) is None


def test_odd_rounds_run_the_segments_in_reverse_so_drift_falls_on_every_system_alike():
    from baige_ray.bench.overhead import round_segments

    every = ["ray_train", "baige", "torchrun_beside_ray", "torchrun"]
    assert round_segments(0, every) == [["torchrun"], ["torchrun_beside_ray", "baige"], ["ray_train"]]
    assert round_segments(1, every) == [["ray_train"], ["baige", "torchrun_beside_ray"], ["torchrun"]]
    assert round_segments(2, every) == round_segments(0, every)
    assert round_segments(1, ["baige", "torchrun"]) == [["baige"], ["torchrun"]]
    assert round_segments(1, ["torchrun"]) == [["torchrun"]]
    assert round_segments(0, ["ray_train", "baige"]) == [["baige"], ["ray_train"]]


def test_headline_ratio_is_the_geometric_mean_of_the_rounds():
    from baige_ray.bench.overhead import geometric_mean, pooled_ratios

    assert geometric_mean([1.1, 1.0 / 1.1]) == pytest.approx(1.0)
    assert geometric_mean([1.02]) == pytest.approx(1.02)
    with pytest.raises(ValueError, match="positive"):
        geometric_mean([])
    systems = {"torchrun": {"step_s": 0.2}, "baige": {"step_s": 0.21}}
    assert pooled_ratios(systems) == {"vs_torchrun": 1.05}
    assert pooled_ratios({"torchrun": {"step_s": 0.2}}) == {}


def test_helper_cpu_counts_processes_running_before_it_started_and_not_later_ones():
    import subprocess
    import sys

    from baige_ray.bench.measure import HelperCpu

    # Each spins 0.5 s of CPU when told to (a line on stdin), says so, then idles until stdin closes.
    spinner = ("import sys, time\nsys.stdin.readline()\nend = time.process_time() + 0.5\n"
               "while time.process_time() < end: pass\nprint('spun', flush=True)\nsys.stdin.read()\n")

    def start() -> subprocess.Popen:
        return subprocess.Popen([sys.executable, "-c", spinner], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    early = start()
    try:
        watch = HelperCpu()
        late = start()
        try:
            for process in (early, late):
                process.stdin.write("go\n")
                process.stdin.flush()
                assert process.stdout.readline().strip() == "spun"
            used = watch.cpu_s()
        finally:
            late.kill()
            late.wait(timeout=30)
    finally:
        early.kill()
        early.wait(timeout=30)
    assert 0.45 <= used < 0.9  # the early process's spin, not the late one's


def test_summary_names_the_daemons_share_and_any_baseline_run_again():
    from baige_ray.bench.overhead import summarize

    text = summarize({
        "systems": {"baige": {"step_s": 0.25, "wall_s": 10.0}, "torchrun": {"step_s": 0.24, "wall_s": 9.0}},
        "vs_torchrun": 1.04, "ray_daemon_cores": 0.06, "cpu_count": 2, "ray_session_slowdown": 1.05,
        "baseline_crashes": ["torchrun: exited with 1"], "rounds": [{"vs_torchrun": 1.04}],
    })
    assert "vs_torchrun = 1.040" in text
    assert "torchrun beside an idle Ray session / torchrun alone: 1.050" in text
    assert "0.060 of 2 cores" in text
    assert "run again after a crash: torchrun: exited with 1" in text
