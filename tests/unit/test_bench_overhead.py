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
    from baige_ray.engines.layout import ParallelLayout
    from baige_ray.models.corpus import CorpusConfig
    from baige_ray.models.gpt import GPTConfig
    from baige_ray.runtime.train_loop import TrainJob

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
