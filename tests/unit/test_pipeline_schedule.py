import pytest
import torch
import torch.distributed as dist

from baige_ray.engines.pipeline_schedule import run_ahead_1f1b_order
from tests.helpers import spawn_ranks


def in_flight_peak(order: list[tuple[str, int]]) -> int:
    peak = live = 0
    for kind, _ in order:
        live += 1 if kind == "F" else -1
        peak = max(peak, live)
    return peak


@pytest.mark.parametrize("stages,micro", [(2, 8), (4, 8), (3, 2), (2, 1)])
def test_without_run_ahead_the_order_is_1f1b(stages, micro):
    for stage in range(stages):
        order = run_ahead_1f1b_order(stage, stages, micro, run_ahead=0)
        warmup = min(micro, stages - stage)
        assert order[:warmup] == [("F", i) for i in range(warmup)]
        assert in_flight_peak(order) == warmup
        steady = order[warmup:]
        assert [kind for kind, _ in steady[: 2 * (micro - warmup)]] == ["B", "F"] * (micro - warmup)


@pytest.mark.parametrize("run_ahead", [0, 1, 3, 100])
def test_every_micro_batch_runs_forward_then_backward_once_in_order(run_ahead):
    stages, micro = 3, 6
    for stage in range(stages):
        order = run_ahead_1f1b_order(stage, stages, micro, run_ahead)
        assert [i for kind, i in order if kind == "F"] == list(range(micro))
        assert [i for kind, i in order if kind == "B"] == list(range(micro))
        for index in range(micro):
            assert order.index(("F", index)) < order.index(("B", index))


def test_run_ahead_deepens_every_stage_but_the_last():
    assert in_flight_peak(run_ahead_1f1b_order(0, 2, 64, run_ahead=3)) == 5
    assert in_flight_peak(run_ahead_1f1b_order(1, 2, 64, run_ahead=3)) == 1
    assert in_flight_peak(run_ahead_1f1b_order(0, 4, 64, run_ahead=2)) == 6
    assert in_flight_peak(run_ahead_1f1b_order(0, 2, 3, run_ahead=5)) == 3  # capped by the micro-batches


def _train_both_schedules(rank: int, port: int, results) -> None:
    import os

    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    from baige_ray.api.configs import TrainConfig
    from baige_ray.engines.factory import build_engine
    from baige_ray.engines.train_job import TrainJob
    from baige_ray.models.corpus import CorpusConfig
    from baige_ray.models.gpt import GPTConfig, language_model_loss
    from baige_ray.parallel.layout import ParallelLayout

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    job = TrainJob(
        model=GPTConfig(num_layers=3, hidden=32, num_heads=2, seq_len=16),
        train=TrainConfig(num_steps=2, global_batch_size=6, micro_batch_size=1, warmup_steps=1, log_every=1),
        data=CorpusConfig(max_bytes=64 * 1024),
    )
    outcome = {}
    for run_ahead in (None, 0, 2):  # None: torch's own Schedule1F1B
        layout = ParallelLayout(pp=2, num_microbatches=6, stage_layers=(1, 2), pipeline_run_ahead=run_ahead or 0)
        engine = build_engine(job, layout, rank, emulated_speed=0.5 if rank == 0 else 1.0)
        if run_ahead is None:
            stage = PipelineStage(engine.stages[0], rank, 2, engine.device, group=engine.meshes["pp"].get_group())
            engine.schedule = Schedule1F1B(stage, 6, loss_fn=language_model_loss)
        losses = [engine.train_step(step)["loss"] for step in range(2)]
        outcome[run_ahead] = (losses, [p.detach().clone() for p in engine.parameters])
    results[rank] = outcome
    dist.destroy_process_group()


def test_run_ahead_schedule_trains_bit_for_bit_like_torch_1f1b():
    results = spawn_ranks(_train_both_schedules, 2)
    for rank in (0, 1):
        reference_losses, reference_params = results[rank][None]
        for run_ahead in (0, 2):
            losses, params = results[rank][run_ahead]
            assert losses == reference_losses
            assert all(torch.equal(a, b) for a, b in zip(params, reference_params))
    assert results[1][None][0][0] is not None  # the last stage saw the losses
