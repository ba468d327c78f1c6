"""GRPO's rollouts drawn on the training ranks themselves (placement "hybrid").

As veRL's hybrid engine and OpenRLHF's colocated mode do, each training rank also samples: at the start
of step t it runs the built-in engine (serving/engine.py: continuous batching, one prefill per group, the
sampled tokens' log-probabilities) over its own weights, through transformers' forward on the very
modules it trains (`ModelPlugin.policy_decoder`). So no weights move after an update, no call crosses a
process between sampling and training, and the rank's cores or device take the two phases in turn.

Rank r trains the samples `indices` of step t (data parallelism: consecutive parts of the batch). It
samples every group those samples fall in, whole, because a group's advantages need all its rewards: a
group split between two ranks is sampled by both, identically (same weights, same seeds). Completion i
of prompt j is sampled with `GRPOConfig.sample_seed(t, j, i)`, the seed the split placement gives it.

A step redone after a fault samples again exactly what it sampled the first time, from the weights the
snapshot restored, even when the job shrank meanwhile: the groups are decoded in fixed batches of
`groups_per_batch` consecutive groups (a rank's share of the job at its full size), whichever rank decodes
them. The batch a row is decoded in changes the last bits of its logits (the matrix products' and the
attention's summation orders), and over a few hundred sampled tokens that turned one in a test run.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from typing import Any

import torch

from baige_ray.api.validation import require_int
from baige_ray.models.generation import KVDecoder
from baige_ray.models.plugin import PolicySamples
from baige_ray.models.policy_loss import group_advantages
from baige_ray.rl.config import GRPOConfig
from baige_ray.rl.objective import pack_rollouts, packed_length
from baige_ray.rl.rollouts import Completion, completion_of
from baige_ray.rl.scoring import Reward, score
from baige_ray.serving.causal_lm_generation import SamplingParams


@dataclasses.dataclass(kw_only=True)
class HybridRollouts(PolicySamples):
    """A GRPO run's rollouts, drawn by each training rank from its own weights as each step begins; small
    and picklable (the reward travels with it, as cloudpickle carries it). The tokenizer is loaded from
    `tokenizer_path` once per process, where the rewards are scored."""

    run_name: str
    prompts: list[str]
    prompt_tokens: list[list[int]]
    reward: Reward
    config: GRPOConfig
    tokenizer_path: str
    trust_remote_code: bool
    eos_token_id: int | None
    pad_id: int
    seq_len: int
    groups_per_batch: int
    max_batch_size: int = 64
    _tokenizer: Any = dataclasses.field(default=None, init=False, repr=False, compare=False)
    _reports: dict[int, dict[str, Any]] = dataclasses.field(default_factory=dict, init=False, repr=False,
                                                             compare=False)

    def __post_init__(self) -> None:
        require_int("HybridRollouts", "groups_per_batch", self.groups_per_batch, minimum=1)
        if self.config.updates_per_iteration != 1:
            raise ValueError(f"GRPOConfig.updates_per_iteration={self.config.updates_per_iteration} is invalid with "
                             "placement='hybrid': each step samples its own rollouts from the weights it starts "
                             "from; expected 1")

    @property
    def fingerprint(self) -> str:
        return f"hybrid-rollouts:{self.run_name}"

    def policy_batch(self, decoder: KVDecoder, step: int, indices: Sequence[int],
                     seed: int) -> tuple[torch.Tensor, torch.Tensor]:
        group_size, first = self.config.group_size, step * self.config.batch_size
        local = [index - first for index in indices]
        if not all(0 <= position < self.config.batch_size for position in local):
            raise ValueError(f"samples {list(indices)[:3]}... are not step {step}'s: the job's global batch must be "
                             f"GRPOConfig.batch_size = {self.config.batch_size}")
        batches = [self._batch_groups(batch)
                   for batch in sorted({position // group_size // self.groups_per_batch for position in local})]
        groups = [group for batch in batches for group in batch]
        started = time.perf_counter()
        completions = [completion for batch in batches for completion in self._sample(decoder, step, batch)]
        sampled = time.perf_counter()
        prompts = self.config.prompt_indices(step, len(self.prompts))
        rewards, advantages = self._scored([prompts[group] for group in groups], completions)
        rows = [groups.index(position // group_size) * group_size + position % group_size for position in local]
        prompt_tokens = [self.prompt_tokens[prompts[groups[row // group_size]]] for row in rows]
        tokens = [completions[row].tokens for row in rows]
        inputs, targets = pack_rollouts(prompt_tokens, tokens, [advantages[row] for row in rows],
                                        packed_length(prompt_tokens, tokens, self.seq_len), pad_id=self.pad_id,
                                        sampled_log_probs=[completions[row].log_probs for row in rows])
        self._reports = {step: {"rewards": [rewards[row] for row in rows], "positions": local,
                                "rollout_s": sampled - started,
                                "scoring_s": time.perf_counter() - sampled}}
        return inputs, targets

    def report(self, step: int) -> dict[str, Any]:
        return self._reports[step]

    def _scored(self, prompts: list[int], completions: list[Completion]) -> tuple[list[float], list[float]]:
        """Each completion's reward and its advantage within its group (`prompts`: each group's prompt)."""
        group_size = self.config.group_size
        texts = [self.prompts[prompt] for prompt in prompts for _ in range(group_size)]
        rewards = score(self.reward, texts, [c.tokens for c in completions], self.tokenizer)
        advantages = group_advantages(torch.tensor(rewards).view(len(prompts), group_size),
                                      scale_by_std=self.config.loss.scale_by_std).flatten().tolist()
        return rewards, advantages

    def _batch_groups(self, batch: int) -> range:
        first = batch * self.groups_per_batch
        return range(first, min(first + self.groups_per_batch, self.config.prompts_per_iteration))

    def _sample(self, decoder: KVDecoder, step: int, groups: range) -> list[Completion]:
        """One engine batch of `groups`' completions."""
        from baige_ray.serving.engine import ContinuousBatchingEngine, EngineLimits, generate_all

        prompts = self.config.prompt_indices(step, len(self.prompts))
        engine = ContinuousBatchingEngine(decoder, eos_token_id=self.eos_token_id,
                                          limits=EngineLimits(max_batch_size=self.max_batch_size,
                                                              max_waiting=len(groups) * self.config.group_size))
        requests = [(self.prompt_tokens[prompts[group]], self._sampling(step, group, sample))
                    for group in groups for sample in range(self.config.group_size)]
        generations = generate_all(engine, [prompt for prompt, _ in requests], [params for _, params in requests])
        return [completion_of(generation, self.eos_token_id) for generation in generations]

    def _sampling(self, step: int, group: int, sample: int) -> SamplingParams:
        return SamplingParams(max_new_tokens=self.config.max_new_tokens, temperature=self.config.temperature,
                              top_k=None, seed=self.config.sample_seed(step, group, sample), log_probs=True)

    @property
    def tokenizer(self) -> Any:
        if self._tokenizer is None:
            from baige_ray.models.tokenizer import load_tokenizer

            self._tokenizer = load_tokenizer(self.tokenizer_path, trust_remote_code=self.trust_remote_code)
        return self._tokenizer
