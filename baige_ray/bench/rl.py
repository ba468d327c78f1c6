"""GRPO in the shared pool against TRL's GRPOTrainer, with a rollout replica and a trainer worker killed.

The task is made here and checked exactly: prompts "a+b=" (a, b < 10); a completion that starts with
the sum scores 1, any other 0.5 x the share of digits in its first four characters (so a policy that
has not learned the sums yet is still told that numbers are the kind of answer wanted). The policy is
a tiny Llama with a tokenizer trained here on local text and the task's lines, fresh weights.

* baige-ray: `GRPOTrainer` on the simulated 2 x 4 cluster, a 2-worker elastic job, `--iterations`
  iterations: reward per iteration, each phase's seconds. By default (`--placement hybrid`, rl/hybrid.py,
  as veRL's hybrid engine) each worker samples its groups with the built-in engine from the weights it
  trains; `--placement split` and `colocated` sample on 2 rollout replicas and refit them each iteration.
* The same run with a trainer worker and a rollout engine SIGKILLed mid-run: every iteration must complete
  and the reward curve equal the fault-free one. Hybrid: rank 1 dies in its backward (fail point
  "backward"), and two iterations later rank 0 dies between two decode steps of its rollout ("sampling"),
  its groups half sampled. Split and colocated: rank 1 in its backward, and the iteration after a replica
  while it holds requests (RolloutFaultPlan), whose requests are re-issued to the other.
* Refit: the policy's weights into a running replica from memory (`reload_weights` of an object ref)
  against through a checkpoint (written as a Hugging Face directory, then reloaded from it), for the tiny
  policy and for a Qwen2.5-0.5B-sized one (bench/rl_refit.py; `refit_vs_checkpoint` is that one's).
* TRL: `trl.GRPOTrainer` on the same model directory, prompts, group size, completions per step,
  completion length, learning rate, loss (GRPO's per-sequence mean, rewards scaled by their group's
  spread, no KL) and iterations, on this machine's CPU in one process (TRL's
  default generation with transformers), the way its documentation starts a run.

`iteration_s` and `trl_iteration_s` are medians over the iterations after the first, each the wall clock
from one iteration's start of training to the next one's (TRL: from one optimizer step's end to the next).
50 iterations by default: an iteration of this policy is about 30 ms, and on 2 shared cores single
iterations of either system vary by a third, so the median of 19 moved by 20% between runs.
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from baige_ray.bench.measure import report_stage
from baige_ray.bench.rl_refit import large_refit, tiny_refit

SEQ_LEN = 32


def policy_shape(hidden: int, layers: int) -> dict[str, int]:
    """A Llama of `hidden` width (heads of 16, two query heads per key-value head) and `layers` layers."""
    return dict(hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                num_attention_heads=hidden // 16, num_key_value_heads=max(1, hidden // 32), max_position_embeddings=64)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--iterations", type=int, default=50)
    parser.add_argument("--prompts-per-iteration", type=int, default=4)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=6)
    parser.add_argument("--learning-rate", type=float, default=3e-3)
    parser.add_argument("--hidden-size", type=int, default=64, help="the policy's width (a multiple of 32)")
    parser.add_argument("--num-layers", type=int, default=2, help="the policy's layers")
    parser.add_argument("--placement", choices=("hybrid", "split", "colocated"), default="hybrid",
                        help="the workers sampling from their own weights (veRL's default), replicas and workers "
                             "on devices of their own, or each device one of each in turns")
    parser.add_argument("--kl-coef", type=float, default=0.0, help="a KL penalty to the starting weights")
    parser.add_argument("--updates-per-iteration", type=int, default=1)
    parser.add_argument("--off-policy-lag", type=int, choices=(0, 1), default=0,
                        help="1: sample iteration t + 1 while iteration t trains (split placement)")
    parser.add_argument("--quick", action="store_true", help="6 iterations")
    parser.add_argument("--no-peer", action="store_true", help="leave TRL out")
    parser.add_argument("--no-large-refit", action="store_true", help="leave out the refit of a 494M policy")
    parser.add_argument("--work-dir", default=None)


def arithmetic_prompts(seed: int = 0) -> list[str]:
    prompts = [f"{a}+{b}=" for a in range(10) for b in range(10)]
    random.Random(seed).shuffle(prompts)
    return prompts


def arithmetic_reward(prompt: str, completion: str) -> float:
    a, b = (int(x) for x in prompt.rstrip("=").split("+"))
    answer, text = str(a + b), completion.strip()
    if text.startswith(answer):
        return 1.0
    return 0.5 * sum(c.isdigit() for c in text[:4]) / 4


def run(args: argparse.Namespace) -> dict[str, Any]:
    from baige_ray.topology.connect import open_cluster

    iterations = 6 if args.quick else args.iterations
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="bench-rl-"))
    model_dir = _make_policy(work, policy_shape(args.hidden_size, args.num_layers))
    prompts = arithmetic_prompts()
    with open_cluster("sim-2x4", log_to_driver=False):
        report_stage(args, "baige-ray GRPO", 0, 5)
        clean = _grpo(args, model_dir, prompts, iterations, work, "bench-rl")
        report_stage(args, "with a trainer worker and a rollout replica killed", 1, 5)
        faulted = _grpo(args, model_dir, prompts, iterations, work, "bench-rl-faulted", faults=True)
        report_stage(args, "refit: memory against a checkpoint", 2, 5)
        refit = tiny_refit(model_dir, clean.training.final_state, work, SEQ_LEN)
    report_stage(args, "refit of a 494M-parameter policy", 3, 5)
    large = None if args.no_large_refit else large_refit(model_dir, work)
    report_stage(args, "TRL GRPOTrainer", 4, 5)
    peer = None if args.no_peer else _trl(args, model_dir, prompts, iterations, work)
    return {"placement": args.placement, **_summary(clean, faulted, refit, large, peer)}


def _make_policy(work: Path, shape: dict[str, int]) -> Path:
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    from baige_ray.models.hf.tiny import write_text_documents
    from baige_ray.models.tokenizer import load_tokenizer, train_bpe_tokenizer

    files = write_text_documents(work / "text", max_bytes=256 * 1024)
    task = work / "text" / "arithmetic.txt"
    task.write_text("\n".join(f"{a}+{b}={a + b}" for a in range(20) for b in range(20)))
    tokenizer_dir = train_bpe_tokenizer([*files, task], work / "tokenizer", vocab_size=512)
    tokenizer = load_tokenizer(tokenizer_dir)
    model_dir = work / "policy"
    config = LlamaConfig(vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.eos_token_id, **shape)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    return model_dir


def _grpo(args, model_dir: Path, prompts: list[str], iterations: int, work: Path, name: str, faults: bool = False):
    from baige_ray.api.configs import RunConfig, ScalingConfig
    from baige_ray.api.elastic import ElasticConfig
    from baige_ray.elastic.faults import FaultPlan
    from baige_ray.models.hf import HFModel
    from baige_ray.models.policy_loss import PolicyLossConfig
    from baige_ray.rl.config import GRPOConfig
    from baige_ray.rl.faults import RolloutFaultPlan
    from baige_ray.rl.trainer import GRPOTrainer, RolloutOptions

    options = {}
    hybrid, colocated = args.placement == "hybrid", args.placement == "colocated"
    if faults and hybrid:  # the workers sample: one killed in its backward, the other as it decodes
        # Two steps apart: a fault is armed as its step is queued, one step ahead, so kills at t and t + 1
        # both land before the first is recovered from and lose every worker at once.
        second = min(iterations - 1, iterations // 2 + 2)
        options = dict(faults=FaultPlan().crash(rank=1, step=iterations // 2, at="backward")
                       .crash(rank=0, step=second, at="sampling"))
    elif faults:  # the trainer in its backward mid-run, a replica mid-batch the iteration after
        options = dict(faults=FaultPlan().crash(rank=1, step=iterations // 2, at="backward"),
                       rollout_faults=RolloutFaultPlan().kill_replica(iteration=iterations // 2 + 1))
    trainer = GRPOTrainer(
        HFModel(model_dir, seq_len=SEQ_LEN), prompts=prompts, reward=arithmetic_reward,
        config=GRPOConfig(num_iterations=iterations, prompts_per_iteration=args.prompts_per_iteration,
                          group_size=args.group_size, max_new_tokens=args.max_new_tokens,
                          learning_rate=args.learning_rate, grad_clip=1.0,
                          updates_per_iteration=args.updates_per_iteration, off_policy_lag=args.off_policy_lag,
                          loss=PolicyLossConfig(kl_coef=args.kl_coef)),
        scaling=ScalingConfig(num_workers=2, placement_timeout_s=180),
        run=RunConfig(name=name, storage_path=work / "runs", show_progress=False),
        elastic=ElasticConfig(num_spares=0 if colocated else 1),
        rollout=RolloutOptions(num_replicas=1 if hybrid else 2, port=8017, placement=args.placement), **options)
    result = trainer.train()
    if faults:
        result.fired = options["rollout_faults"].fired if "rollout_faults" in options else []
        result.planned_worker_kills = [{"rank": f.rank, "step": f.step, "at": f.at} for f in options["faults"].faults]
    return result


def _trl(args, model_dir: Path, prompts: list[str], iterations: int, work: Path) -> dict[str, Any]:
    """TRL's GRPOTrainer on the same task, one process on this machine's CPU; seconds per step."""
    import trl
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    class StepClock(TrainerCallback):
        def __init__(self) -> None:
            self.ends: list[float] = []
            self.rewards: list[float] = []

        def on_step_end(self, *_: Any, **__: Any) -> None:
            self.ends.append(time.perf_counter())

        def on_log(self, _args, _state, _control, logs=None, **__: Any) -> None:
            if logs and "reward" in logs:
                self.rewards.append(float(logs["reward"]))

    def reward(prompts: list[str], completions: list[str], **_: Any) -> list[float]:
        return [arithmetic_reward(p, c) for p, c in zip(prompts, completions)]

    batch = args.prompts_per_iteration * args.group_size
    config = GRPOConfig(
        output_dir=str(work / "trl"), per_device_train_batch_size=batch, num_generations=args.group_size,
        max_completion_length=args.max_new_tokens, learning_rate=args.learning_rate, lr_scheduler_type="constant",
        max_steps=iterations, beta=0.0, temperature=1.0, top_k=0, loss_type="grpo", scale_rewards="group",
        max_grad_norm=1.0, weight_decay=0.0, use_cpu=True, bf16=False, report_to=[], save_strategy="no",
        logging_steps=1, seed=0, disable_tqdm=True)
    clock = StepClock()
    trainer = GRPOTrainer(model=str(model_dir), reward_funcs=reward, args=config,
                          train_dataset=Dataset.from_dict({"prompt": prompts}), callbacks=[clock])
    started = time.perf_counter()
    trainer.train()
    steps = [b - a for a, b in zip([started, *clock.ends], clock.ends)]
    return {"step_s": steps, "rewards": clock.rewards, "version": trl.__version__}


def _summary(clean, faulted, refit: dict[str, float], large: dict[str, Any] | None,
             peer: dict[str, Any] | None) -> dict[str, Any]:
    def periods(result) -> list[float]:  # wall clock between iterations going to training, as TRL's steps
        return [r.period_s for r in result.iterations[1:]]

    rewards, faulted_rewards = clean.rewards, faulted.rewards
    head = max(1, min(3, len(rewards) // 3))
    result = {
        "reward_first": statistics.fmean(rewards[:head]),
        "reward_last": statistics.fmean(rewards[-head:]),
        "rewards": rewards,
        "iteration_s": statistics.median(periods(clean)),
        "phases_s": {phase: statistics.median(getattr(r, phase) for r in clean.iterations[1:-1] or clean.iterations)
                     for phase in ("rollout_s", "scoring_s", "training_s", "refit_s", "release_s")},
        "shared_devices": clean.shared_devices,
        "refit_s": refit["memory_s"],
        "refit_checkpoint_s": refit["checkpoint_s"],
        "refit_vs_checkpoint_tiny": refit["checkpoint_s"] / refit["memory_s"],
        "faulted_rewards": faulted_rewards,
        "faulted_reward_max_diff": max(abs(a - b) for a, b in zip(rewards, faulted_rewards)),
        "faulted_iterations": len(faulted.iterations),
        "faulted_recoveries": [{k: r[k] for k in ("lost_steps", "resumed_step") if k in r}
                               for r in faulted.training.recoveries],
        "faulted_reissued": sum(r.reissued for r in faulted.iterations),
        "replica_kills": len(faulted.fired),
        "planned_worker_kills": faulted.planned_worker_kills,  # the recoveries say they landed
    }
    if large is not None:
        result.update(refit_large=large, refit_vs_checkpoint=large["ratio"])
    if peer is not None:
        result.update(trl_iteration_s=statistics.median(peer["step_s"][1:]), trl_rewards=peer["rewards"],
                      trl_version=peer["version"])
        result["vs_trl"] = result["iteration_s"] / result["trl_iteration_s"]
    return result


def summarize(result: dict[str, Any]) -> str:
    phases = ", ".join(f"{k} {v:.2f}" for k, v in result["phases_s"].items())
    lines = [f"reward: {result['reward_first']:.3f} over the first iterations, {result['reward_last']:.3f} over "
             "the last",
             f"iteration: {result['iteration_s']:.2f} s ({phases})",
             f"refit from memory {result['refit_s']:.2f} s, through a checkpoint {result['refit_checkpoint_s']:.2f} s",
             *_large_refit_lines(result.get("refit_large")),
             f"faulted run: {result['faulted_iterations']} iterations, reward max |diff| "
             f"{result['faulted_reward_max_diff']:.3g}, {result['faulted_reissued']} requests re-issued, "
             f"{len(result['faulted_recoveries'])} recoveries; kills planned: "
             + ", ".join(f"rank {k['rank']} at step {k['step']} ({k['at']})" for k in result["planned_worker_kills"])]
    if "trl_iteration_s" in result:
        lines.append(f"TRL {result['trl_version']} GRPOTrainer: {result['trl_iteration_s']:.2f} s per iteration")
    return "\n".join(lines)


def _large_refit_lines(large: dict[str, Any] | None) -> list[str]:
    if large is None:
        return []
    return [f"refit of {large['parameters'] / 1e6:.0f}M parameters: from memory {large['memory_s']:.2f} s, through a "
            f"checkpoint {large['checkpoint_s']:.2f} s ({large['ratio']:.1f}x; first refit "
            f"{large['first_memory_s']:.2f} s / {large['first_checkpoint_s']:.2f} s)"]
