"""GRPO's rollouts drawn on the training ranks (rl/hybrid.py): a whole-model stage generates as its
transformers model does, on the very weights it trains; two ranks draw what one does; each step samples
from the weights the step before left, nothing copied."""

from __future__ import annotations

import pytest
import torch

from baige_ray.api.configs import TrainConfig
from baige_ray.engines.torch_engine import TorchEngine
from baige_ray.engines.train_job import TrainJob
from baige_ray.models.hf import HFModel
from baige_ray.models.plugin import plugin_for
from baige_ray.models.tokenizer import load_tokenizer
from baige_ray.parallel.layout import ParallelLayout
from baige_ray.rl.config import GRPOConfig
from baige_ray.rl.hybrid import HybridRollouts
from baige_ray.rl.objective import PolicyObjective, unpack_targets
from baige_ray.rl.placement import check_hybrid
from baige_ray.serving.causal_lm_generation import SamplingParams
from baige_ray.serving.engine import ContinuousBatchingEngine, generate_all
from tests.hf_helpers import SEQ_LEN, build_tiny_hf

PROMPTS = ["def ", "class ", "import ", "return ", "if ", "for "]
CONFIG = GRPOConfig(num_iterations=2, prompts_per_iteration=3, group_size=4, max_new_tokens=8, learning_rate=1e-2)


def vowels(prompt: str, completion: str) -> float:
    return sum(c in "aeiou" for c in completion) / max(1, len(completion))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return build_tiny_hf(tmp_path_factory.mktemp("tiny-hybrid"))


@pytest.fixture()
def source(tiny):
    tokenizer = load_tokenizer(tiny.model_dir)
    return HybridRollouts(run_name="hybrid", prompts=PROMPTS, prompt_tokens=[tokenizer(p)["input_ids"] for p in PROMPTS],
                          reward=vowels, config=CONFIG, tokenizer_path=str(tiny.model_dir), trust_remote_code=False,
                          eos_token_id=tokenizer.eos_token_id, pad_id=tokenizer.eos_token_id, seq_len=SEQ_LEN,
                          groups_per_batch=1)


def engine_of(tiny, source) -> TorchEngine:
    train = TrainConfig(num_steps=2, global_batch_size=CONFIG.batch_size, learning_rate=1e-2, warmup_steps=0,
                        min_learning_rate=1e-2)
    job = TrainJob(model=HFModel(tiny.model_dir, seq_len=SEQ_LEN), train=train, data=source,
                   objective=PolicyObjective())
    return TorchEngine(job, ParallelLayout())


def test_a_whole_model_stage_generates_as_its_transformers_model_and_on_its_own_weights(tiny):
    from transformers import AutoModelForCausalLM

    plugin = plugin_for(HFModel(tiny.model_dir, seq_len=SEQ_LEN))
    (stage,) = plugin.build_stages([(0, plugin.num_layers, True, True)], torch.device("cpu"), seed=0)
    causal_lm = stage.as_causal_lm()
    assert {id(p) for p in causal_lm.parameters()} == {id(p) for p in stage.parameters()}
    reference = AutoModelForCausalLM.from_pretrained(tiny.model_dir).eval()
    tokens = torch.tensor([[5, 17, 42, 9, 3]])
    with torch.no_grad():
        torch.testing.assert_close(causal_lm.eval()(tokens).logits, reference(tokens).logits)
        stage.lm_head.weight.mul_(2.0)  # as an optimizer step changes it: in place
        reference.lm_head.weight.mul_(2.0)
        torch.testing.assert_close(causal_lm(tokens).logits, reference(tokens).logits)
    with pytest.raises(ValueError, match="not the whole model"):
        plugin.build_stages([(0, 1, True, False)], torch.device("cpu"), seed=0)[0].as_causal_lm()


def test_two_ranks_draw_what_one_does_and_what_a_replica_of_the_same_weights_samples(tiny, source):
    engine = engine_of(tiny, source)
    decoder = engine.plugin.policy_decoder(engine.policy_stage())
    batch = CONFIG.batch_size
    whole = source.policy_batch(decoder, 1, range(batch, 2 * batch), seed=0)
    whole_report = source.report(1)
    # Rank 0 trains samples 0-5, rank 1 6-11: the second group (4-7) is split and both sample it whole.
    halves = [source.policy_batch(decoder, 1, range(batch + start, batch + start + batch // 2), seed=0)
              for start in (0, batch // 2)]
    assert source.report(1)["rewards"] == whole_report["rewards"][batch // 2:]
    for part, (inputs, targets) in zip((slice(0, 6), slice(6, 12)), halves):
        length = inputs.shape[1]
        assert torch.equal(inputs, whole[0][part, :length])
        # bit for bit: each group is decoded in a batch of its own (groups_per_batch 1) whoever decodes it
        torch.testing.assert_close(targets, whole[1][part, :length], equal_nan=True, rtol=0, atol=0)
    # A replica holding the same weights (split placement) samples the same tokens with the same seeds.
    replica = ContinuousBatchingEngine(engine.plugin.build_decoder(engine.export_weights()),
                                       eos_token_id=source.eos_token_id)
    prompts = CONFIG.prompt_indices(1, len(PROMPTS))
    params = [SamplingParams(max_new_tokens=CONFIG.max_new_tokens, temperature=1.0, top_k=None,
                             seed=CONFIG.sample_seed(1, group, sample), log_probs=True)
              for group in range(3) for sample in range(4)]
    served = generate_all(replica, [source.prompt_tokens[prompts[i // 4]] for i in range(batch)], params)
    packed = unpack_targets(whole[1])
    for row, generation in enumerate(served):
        completion = packed.tokens[row][packed.mask[row] > 0].long().tolist()
        assert completion[:len(generation.tokens)] == generation.tokens
    assert len(whole_report["rewards"]) == batch and whole_report["rollout_s"] > 0


def test_each_step_samples_from_the_weights_the_step_before_left(tiny, source):
    engine = engine_of(tiny, source)
    first = engine.train_step(0)
    assert len(first["policy_samples"]["rewards"]) == CONFIG.batch_size
    assert engine.module.training  # sampling ran in eval mode; training goes on in train mode
    inputs, _ = engine.batch(1)  # drawn by the rank's decoder, which saw step 0's update in place
    fresh = engine_of(tiny, source)
    fresh.import_state(engine.export_state())
    again, _ = fresh.batch(1)
    assert torch.equal(inputs, again)
    untrained, _ = engine_of(tiny, source).batch(1)
    assert not torch.equal(inputs, untrained)  # step 0's update changed what step 1 samples


@pytest.mark.parametrize("change, field", [
    (dict(kl_coef=0.1), "PolicyLossConfig.kl_coef"),
    (dict(updates_per_iteration=2), "GRPOConfig.updates_per_iteration"),
    (dict(num_replicas=2), "RolloutOptions.num_replicas"),
    (dict(engine="vllm"), "RolloutOptions.engine"),
    (dict(layout=ParallelLayout(dp=2, data_parallel="fsdp2")), "layout"),
    (dict(layout="auto"), "layout"),
])
def test_a_hybrid_run_refuses_what_the_training_ranks_cannot_sample_with(change, field):
    arguments = dict(num_replicas=1, engine="builtin", updates_per_iteration=1, kl_coef=0.0, layout=None,
                     rollout_faults=None)
    check_hybrid("hybrid", **arguments)
    check_hybrid("hybrid", **{**arguments, "layout": ParallelLayout(dp=4)})
    with pytest.raises(ValueError, match=f"{field}=.* is invalid with placement='hybrid'"):
        check_hybrid("hybrid", **{**arguments, **change})


def test_the_ranks_reports_join_and_make_one_iteration_record_per_step():
    from baige_ray.api.result import StepMetrics
    from baige_ray.elastic.accounts import joined_reports
    from baige_ray.rl.trainer import hybrid_records

    whole = [1.0, 0.0, 0.5]  # each rank's report holds the whole batch's rewards (actors/worker.py gathers them)
    joined = joined_reports([{"policy_samples": {"rewards": whole, "rollout_s": 0.02, "scoring_s": 0.001}},
                             {"policy_samples": {"rewards": whole, "rollout_s": 0.03, "scoring_s": 0.002}}])
    assert joined == {"rewards": whole, "rollout_s": 0.03, "scoring_s": 0.002}

    def step(index: int, finished_at: float | None, rewards: list[float]) -> StepMetrics:
        return StepMetrics(step=index, loss=0.1, learning_rate=1e-3, step_time_s=0.05, tokens=10,
                           finished_at=finished_at, policy_samples={**joined, "rewards": rewards})

    # Step 1 was redone after a fault: its last record counts; step 2's results died with a worker.
    records = hybrid_records([step(0, 10.0, [0.0]), step(1, 10.1, [1.0]), step(1, 10.5, [0.5]), step(2, None, [1.0])])
    assert [r.iteration for r in records] == [0, 1, 2] and [r.rewards for r in records] == [[0.0], [0.5], [1.0]]
    assert records[1].period_s == pytest.approx(0.5) and all(r.period_s != r.period_s for r in (records[0], records[2]))
    assert records[1].training_s == pytest.approx(0.05 - 0.03 - 0.002) and records[1].refit_s == 0.0
