"""The loss of a step is the mean over all its trained tokens, in every layout.

Conversations, packed several to a sequence, train unequal numbers of tokens, so micro-batches and
replicas hold unequal counts. The step-0 gradients at accumulation 1 and 4, on two data-parallel ranks
and on two pipeline stages must all be the gradient of (summed token losses) / (the step's trained
tokens) computed by transformers alone, given the same per-conversation positions (from which it masks
attention to each conversation); two tensor-parallel ranks and ZeRO-2 over two must give one process's
losses. The mean of micro-batch means, which the engines used to take, is not that gradient.
"""

import pytest
import torch
import torch.distributed as dist

from tests.helpers import spawn_ranks

SEQ_LEN = 128
GLOBAL_BATCH = 8


@pytest.fixture(scope="module")
def chat_data(tmp_path_factory):
    from tests.hf_helpers import build_chat_data

    tiny, _, dataset = build_chat_data(tmp_path_factory.mktemp("sft"), count=24, seq_len=SEQ_LEN)
    return tiny.model_dir, dataset


def _job(model_dir, dataset, micro_batch_size):
    from baige_ray import TrainConfig
    from baige_ray.engines.train_job import TrainJob
    from baige_ray.models.hf import HFModel

    train = TrainConfig(num_steps=1, global_batch_size=GLOBAL_BATCH, micro_batch_size=micro_batch_size, seed=3)
    return TrainJob(model=HFModel(model_dir, seq_len=SEQ_LEN), train=train, data=dataset)


def step_zero_gradients(engine) -> dict[str, torch.Tensor]:
    """The gradients of the first step's forward and backward, by canonical name (before the update)."""
    engine.tokens_per_sample = engine.step_tokens_per_sample(0)
    engine.forward_backward(*engine.batch(0), engine.positions(0))
    return {name.split(".", 1)[1]: param.grad.detach().clone() for name, param in engine.module.named_parameters()}


def _two_rank_gradients(rank: int, port: int, results, model_dir, dataset) -> None:
    import os

    from baige_ray.engines.factory import build_engine
    from baige_ray.parallel.layout import ParallelLayout

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    layouts = {"dp2": ParallelLayout(dp=2), "pp2": ParallelLayout(pp=2, num_microbatches=4)}
    for name, layout in layouts.items():
        engine = build_engine(_job(model_dir, dataset, GLOBAL_BATCH // 4), layout, rank)
        results[(name, rank)] = step_zero_gradients(engine)
    # Tensor parallelism's and ZeRO's gradients are sharded: their losses over two steps against one process's.
    for name, layout in {"tp2": ParallelLayout(tp=2), "zero2": ParallelLayout(dp=2, data_parallel="zero2")}.items():
        engine = build_engine(_job(model_dir, dataset, GLOBAL_BATCH // 4), layout, rank)
        results[(name, rank)] = [engine.train_step(step)["loss"] for step in range(2)]
    dist.destroy_process_group()


def transformers_gradients(model_dir, dataset, micro_means: int = 0) -> dict[str, torch.Tensor]:
    """transformers alone on the whole batch: summed token losses over the trained tokens' count, or with
    `micro_means` > 0, the mean over that many micro-batches of each one's token mean."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    inputs, targets = dataset.batch(range(GLOBAL_BATCH), seed=3)
    positions = dataset.positions(range(GLOBAL_BATCH), seed=3)
    # Without a cache (as in training): with one, transformers builds a plain causal mask whatever the positions.
    logits = model(input_ids=inputs, position_ids=positions, use_cache=False).logits
    losses = torch.nn.functional.cross_entropy(logits.transpose(1, 2), targets, reduction="none")  # 0 if ignored
    trained = (targets != -100).float()
    if micro_means:
        chunks = zip(losses.chunk(micro_means), trained.chunk(micro_means))
        loss = torch.stack([chunk.sum() / counted.sum() for chunk, counted in chunks]).mean()
    else:
        loss = losses.sum() / trained.sum()
    loss.backward()
    return {name: param.grad for name, param in model.named_parameters()}


def test_step_gradients_are_the_mean_over_the_steps_trained_tokens_in_every_layout(chat_data):
    from baige_ray.engines.factory import build_engine
    from baige_ray.parallel.layout import ParallelLayout

    model_dir, dataset = chat_data
    counts = [int((t != -100).sum()) for t in dataset.batch(range(GLOBAL_BATCH), seed=3)[1].chunk(4)]
    assert len(set(counts)) > 1, f"the micro-batches must train unequal token counts: {counts}"
    documents = (dataset.positions(range(GLOBAL_BATCH), seed=3) == 0).sum(dim=1)
    assert documents.max() > 2, "sequences pack several conversations (and padding)"
    reference = transformers_gradients(model_dir, dataset)
    mean_of_means = transformers_gradients(model_dir, dataset, micro_means=4)
    assert not torch.allclose(mean_of_means["lm_head.weight"], reference["lm_head.weight"], rtol=1e-2)

    runs = {f"accumulation {GLOBAL_BATCH // micro}": step_zero_gradients(
        build_engine(_job(model_dir, dataset, micro), ParallelLayout())) for micro in (GLOBAL_BATCH, GLOBAL_BATCH // 4)}
    ranks = spawn_ranks(_two_rank_gradients, 2, model_dir, dataset)
    runs["dp2 (rank 1)"] = ranks[("dp2", 1)]
    runs["pp2"] = {**ranks[("pp2", 0)], **ranks[("pp2", 1)]}
    one_process = build_engine(_job(model_dir, dataset, GLOBAL_BATCH // 4), ParallelLayout())
    expected = [one_process.train_step(step)["loss"] for step in range(2)]
    assert ranks[("tp2", 0)] == pytest.approx(expected, rel=1e-5)
    assert [sum(pair) / 2 for pair in zip(ranks[("zero2", 0)], ranks[("zero2", 1)])] == pytest.approx(expected, rel=1e-5)
    for run, gradients in runs.items():
        assert gradients.keys() == reference.keys(), run
        for name, gradient in gradients.items():
            torch.testing.assert_close(gradient, reference[name], rtol=1e-4, atol=1e-7, msg=f"{run}: {name}")


def test_grpo_token_mean_is_over_the_steps_completion_tokens():
    """DAPO's token aggregate: two micro-batches given the step's count add up to the token mean of both."""
    from baige_ray.models.policy_loss import PolicyLossConfig
    from baige_ray.rl.objective import PolicyObjective, pack_rollouts

    objective = PolicyObjective(loss_config=PolicyLossConfig(aggregate="token"))
    inputs, targets = pack_rollouts([[1, 2], [3], [4, 5], [6]], [[7] * 9, [8], [9, 9], [7] * 5], [1.0, -1.0, 0.5, 2.0],
                                    seq_len=12)
    logits = torch.randn(4, 12, 16)
    whole = objective.loss(logits, targets)
    assert objective.normalises_by_tokens and objective.trained_tokens(targets) == 17
    per_sample = objective.trained_tokens(targets) / 4
    halves = [objective.loss(logits[s], targets[s], per_sample) for s in (slice(0, 2), slice(2, 4))]
    torch.testing.assert_close(sum(halves) / 2, whole)
    assert not torch.allclose(sum(objective.loss(logits[s], targets[s]) for s in (slice(0, 2), slice(2, 4))) / 2,
                              whole)
