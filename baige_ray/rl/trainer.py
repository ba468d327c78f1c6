"""`GRPOTrainer`: reinforcement learning in the shared pool, rollouts on serving replicas, the policy an
elastic training job, weights handed from one to the other in memory.

Each iteration t:
  1. rollout: every completion of the iteration's prompts requested from the rollout replicas
     (rl/rollouts.py: seeded, re-issued when a replica dies);
  2. scoring: the user's reward on each (prompt, completion) text, advantages within each group;
  3. training: the packed rollouts published on the run's board (actors/rollout_board.py) and step t
     let through the job's gate (`launch(steps_allowed=...)`); the job trains it in its layout and
     recovers from a lost worker from memory, as any elastic job;
  4. refit: the job's newest in-memory snapshot (step t) loaded into every rollout replica in place
     (`reload_weights`), which waits until each has swapped; a sync that stalls is retried once, then
     the run fails with the replicas still behind.
Placement "hybrid" has no replicas: the job's own workers sample, score and train in each step
(rl/hybrid.py), nothing gates its steps and nothing is refit.

The rollout of t + 1 needs the weights of step t: the phases run in turn, unless `off_policy_lag` is 1:
then the rollout of t + 1 runs while step t trains, from the weights of step t - 1, and the refit of step
t's weights follows them both (before step t + 1 may change the snapshot it reads). Placement "split": the
replicas and the workers hold devices of their own. "colocated": each device holds one replica and one
worker (Ray shares of it: 0.55 and 0.35, 0.1 left for the reference policy), and after each rollout the
replicas' engines give their device memory back (the running batch's keys and values; on an accelerator
the weights, to host memory) until the refit's new weights wake them.

With `updates_per_iteration` u > 1, iteration t's rollouts serve steps [t u, (t + 1) u) and the refit
follows the last of them. The sampling engine reports each token's log-probability, so every update's
ratio is taken against the policy that sampled. With a KL penalty, a reference actor
(rl/reference.py) scores each completion under the starting weights before the rollouts are published.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import ray
import torch

from baige_ray.api.configs import RunConfig, ScalingConfig, TrainConfig
from baige_ray.api.connection import connect_ray
from baige_ray.api.elastic import ElasticConfig
from baige_ray.api.validation import require_choice, require_int, require_number
from baige_ray.models.policy_loss import group_advantages
from baige_ray.rl.config import GRPOConfig
from baige_ray.rl.faults import RolloutFaultPlan
from baige_ray.rl.hybrid import HybridRollouts
from baige_ray.rl.objective import PolicyObjective, pack_rollouts, packed_length
from baige_ray.rl.placement import (
    PLACEMENTS,
    check_colocation,
    check_devices,
    check_hybrid,
    check_off_policy,
    device_shares,
    devices_needed,
    shared_devices,
)
from baige_ray.rl.rollout_source import RolloutSource, start_board
from baige_ray.rl.reference import start_reference
from baige_ray.rl.rollouts import BusyReplicas, Completion, RolloutClient, RolloutGroup
from baige_ray.rl.scoring import Reward, score
from baige_ray.rl.split_sizing import (
    ServeReplicas,
    SplitMove,
    SplitSizer,
    SplitSizing,
    job_sizes,
    pool_devices_for,
)
from baige_ray.serving.causal_lm_generation import SamplingParams

logger = logging.getLogger(__name__)
STEP_WAIT_S = 30.0  # one long poll of the job; a step (or its recovery) may take longer: it asks again
SNAPSHOT_POLL_S = 0.05  # a snapshot is copied just after its step; each look assembles the whole model: not faster


@dataclasses.dataclass(kw_only=True, frozen=True)
class RolloutOptions:
    """The rollout replicas: how many, on which engine ("builtin" or "vllm"), how many sequences each
    decodes together, the share of a device each holds where the pool has devices; the share of one
    the KL penalty's reference actor holds (below 1 - `device_share`, it fits beside a replica).

    `placement` "colocated" puts one replica and one training worker on each device, taking turns
    (as many replicas as workers, no spares, the built-in engine: vLLM's sleep mode is not wired in);
    it sets the shares itself. "hybrid" starts no replicas: each training worker samples from its own
    weights as a step begins (rl/hybrid.py; `num_replicas` stays 1, the built-in engine). `sizing` (split only) moves devices between the replicas and the workers
    as the phases' measured times show one of them holds the iteration up (rl/split_sizing.py)."""

    num_replicas: int = 1
    engine: str = "builtin"
    max_batch_size: int = 64
    port: int = 8000
    device_share: float = 1.0
    reference_device_share: float = 1.0
    placement: str = "split"
    sizing: SplitSizing | None = None

    def __post_init__(self) -> None:
        require_int("RolloutOptions", "num_replicas", self.num_replicas, minimum=1)
        require_choice("RolloutOptions", "placement", self.placement, PLACEMENTS)
        if self.sizing is not None and self.placement != "split":
            raise ValueError(f"RolloutOptions.sizing is invalid with placement={self.placement!r}: colocated "
                             "replicas and workers share every device, there is no split to size")
        if self.placement == "colocated" and self.engine != "builtin":
            raise ValueError(f"RolloutOptions.engine={self.engine!r} is invalid with placement='colocated': the "
                             "replicas give their device memory back between rollouts on the built-in engine only")
        for name in ("device_share", "reference_device_share"):
            require_number("RolloutOptions", name, getattr(self, name), minimum=0, exclusive_minimum=True, maximum=1)


@dataclasses.dataclass(kw_only=True)
class IterationRecord:
    iteration: int
    rewards: list[float]
    rollout_s: float
    scoring_s: float  # the reward, and the reference policy's log-probabilities where there is a KL penalty
    training_s: float = math.nan  # the step of this iteration's rollouts, from its gate opening to its end
    refit_s: float = math.nan  # its weights into every rollout replica (nan for the last iteration: none follows)
    reissued: int = 0  # completions requested again after their replica died
    release_s: float = 0.0  # colocated: the replicas' engines giving their device memory back for training
    loss: float | None = None
    replicas: int = 0  # the rollout replicas and training workers the iteration ran on
    workers: int = 0
    period_s: float = math.nan  # wall clock from the previous iteration's rollouts going to training to this one's

    @property
    def reward_mean(self) -> float:
        return float(np.mean(self.rewards))


@dataclasses.dataclass(kw_only=True)
class RLResult:
    iterations: list[IterationRecord]
    training: Any  # the elastic job's Result: losses, recoveries, final weights
    rollout_failures: list[str]
    shared_devices: int = 0  # devices holding a rollout replica and a training worker, as the job started
    moves: list[SplitMove] = dataclasses.field(default_factory=list)  # RolloutOptions.sizing's, in order

    @property
    def rewards(self) -> list[float]:
        return [record.reward_mean for record in self.iterations]


@dataclasses.dataclass(frozen=True)
class _Rollouts:
    """One iteration's sampled and scored completions, not yet on the board."""

    record: IterationRecord
    prompts: list[tuple[int, ...]]  # each completion's prompt tokens
    completions: list[Completion]
    reference: list[list[float]] | None  # the KL penalty's reference log-probabilities


class GRPOTrainer:
    """GRPO of a Hugging Face causal LM (`HFModel` of a local directory: rollout replicas and the
    training job both start from its weights) on `prompts` (text) scored by `reward(prompt,
    completion)`, a Python callable returning a finite number."""

    def __init__(self, model: Any, *, prompts: Sequence[str], reward: Reward, config: GRPOConfig,
                 scaling: ScalingConfig | None = None, run: RunConfig | None = None,
                 elastic: ElasticConfig | None = None, layout: Any = None, rollout: RolloutOptions | None = None,
                 faults: Any = None, rollout_faults: RolloutFaultPlan | None = None):
        from baige_ray.models.tokenizer import load_tokenizer

        if getattr(model, "path", None) is None:
            raise ValueError(f"model={model!r} is invalid: expected an HFModel of a local directory (the rollout "
                             "replicas load it)")
        if not prompts or not all(isinstance(p, str) and p for p in prompts):
            raise ValueError("prompts is invalid: expected a non-empty sequence of non-empty strings")
        if not callable(reward):
            raise ValueError(f"reward={reward!r} is invalid: expected a callable reward(prompt, completion) -> float")
        self.model, self.reward, self.config = model, reward, config
        self.scaling, self.run = scaling or ScalingConfig(), run or RunConfig()
        self.elastic, self.layout, self.rollout = elastic, layout, rollout or RolloutOptions()
        num_spares = (elastic or ElasticConfig()).num_spares
        check_colocation(self.rollout.placement, num_replicas=self.rollout.num_replicas,
                         num_workers=self.scaling.num_workers, num_spares=num_spares)
        check_off_policy(config.off_policy_lag, self.rollout.placement, sized=self.rollout.sizing is not None)
        check_hybrid(self.rollout.placement, num_replicas=self.rollout.num_replicas, engine=self.rollout.engine,
                     updates_per_iteration=config.updates_per_iteration, kl_coef=config.loss.kl_coef,
                     layout=layout, rollout_faults=rollout_faults)
        if config.group_size > self.rollout.max_batch_size:
            raise ValueError(f"GRPOConfig.group_size={config.group_size} is invalid with RolloutOptions.max_batch_size="
                             f"{self.rollout.max_batch_size}: a group is decoded in one replica's batch")
        self.shares = device_shares(self.rollout.placement, replica=self.rollout.device_share,
                                    worker=self.scaling.device_share, reference=self.rollout.reference_device_share)
        self._needed = devices_needed(self.shares, num_replicas=self.rollout.num_replicas,
                                      num_workers=self.scaling.num_workers + num_spares,
                                      reference=config.loss.kl_coef > 0)
        # The trainer workers' faults (FaultPlan, by rank and step) and the replicas' (by iteration).
        self.faults, self.rollout_faults = faults, rollout_faults
        self.tokenizer = load_tokenizer(model.tokenizer or model.path, trust_remote_code=model.trust_remote_code)
        self.prompts = list(prompts)
        self.prompt_tokens = [list(self.tokenizer(p)["input_ids"]) for p in self.prompts]
        self._check_lengths()
        self.pad_id = next((t for t in (self.tokenizer.pad_token_id, self.tokenizer.eos_token_id) if t is not None), 0)
        self._reference: ray.actor.ActorHandle | None = None  # the KL penalty's, while a run holds one

    def _check_lengths(self) -> None:
        longest = max(len(tokens) for tokens in self.prompt_tokens)
        if longest + self.config.max_new_tokens > self.model.seq_len + 1:
            raise ValueError(f"GRPOConfig.max_new_tokens={self.config.max_new_tokens} is invalid: the longest prompt "
                             f"has {longest} tokens and a rollout must fit the model's seq_len={self.model.seq_len} "
                             f"(+1), so at most {self.model.seq_len + 1 - longest}")

    # ----- the run -----

    def train(self) -> RLResult:
        from baige_ray.jobs.launch import launch
        from baige_ray.serving.app import serve, shutdown

        if not ray.is_initialized():  # RAY_ADDRESS's cluster, or a local one, as launch and serve join it
            connect_ray(logging_level=logging.WARNING)
        check_devices(self._needed, ray.cluster_resources().get("GPU", 0.0))
        if self.rollout.placement == "hybrid":
            return self._train_hybrid()
        name = f"{self.run.name}-rollouts"  # its own route: other applications may hold "/"
        info = serve(self.model.path, model_config=self.model, name=name, route_prefix=f"/{name}",
                     num_replicas=self.rollout.num_replicas, engine=self.rollout.engine,
                     max_batch_size=self.rollout.max_batch_size, port=self.rollout.port,
                     max_ongoing_requests=1, device_share=self.shares.replica)  # one share each (rl/rollouts.py)
        updates = self.config.updates_per_iteration
        board = start_board(self.run.name, self.config.batch_size, keep=2 * updates)
        if self.config.loss.kl_coef > 0:
            self._reference = start_reference(self.run.name, self.model, self.shares.reference)
        job = None
        try:
            client = RolloutClient(info.app_name, info.deployment_name, eos_token_id=self.tokenizer.eos_token_id,
                                   retry_s=self.config.rollout_retry_s)
            failures: list[str] = []
            split = (self.rollout.num_replicas, self.scaling.num_workers)  # replicas, workers
            records = [self._publish(self._rollout(0, client, failures, split), board)]
            records[-1].release_s = self._release_devices(info)
            job = launch(self.model, data=RolloutSource(self.run.name),
                         objective=PolicyObjective(loss_config=self.config.loss), steps_allowed=updates,
                         train=self._train_config(),
                         scaling=dataclasses.replace(self.scaling, device_share=self.shares.worker),
                         run=dataclasses.replace(self.run, show_progress=False), elastic=self.elastic,
                         layout=self.layout, faults=self.faults)
            opened = published = time.perf_counter()
            shared = None  # devices a replica and a worker share, read once the first step is done
            sizer = None  # RolloutOptions.sizing's, made once the job runs
            for iteration in range(1, self.config.num_iterations):
                # One step off-policy: sampled now, beside the training of the iteration before.
                ahead = self._rollout(iteration, client, failures, split) if self.config.off_policy_lag else None
                status = self._wait_for_steps(job, iteration * updates)
                records[-1].training_s = time.perf_counter() - opened
                shared = self._shared_devices(info, job) if shared is None else shared
                records[-1].refit_s = self._refit(job, info, iteration * updates - 1)
                if self.rollout.sizing is not None:
                    sizer = sizer or self._split_sizer(job)
                    self._size_split(sizer, records[-1], info, job)
                    split = (sizer.replicas, sizer.workers)
                rollouts = ahead or self._rollout(iteration, client, failures, split)
                records.append(self._publish(rollouts, board, tight=status.get("pipeline_stages") == 1))
                records[-1].release_s = self._release_devices(info)
                job.allow_steps((iteration + 1) * updates)
                opened = time.perf_counter()
                records[-1].period_s, published = opened - published, opened
            if shared is None:
                self._wait_for_steps(job, 1)
                shared = self._shared_devices(info, job)
            training, job = job.wait(), None
            records[-1].training_s = time.perf_counter() - opened
        finally:
            if job is not None:  # an iteration failed: its training job (a detached controller) goes too
                job.kill()
            shutdown(info)
            ray.kill(board)
            if self._reference is not None:
                ray.kill(self._reference)
                self._reference = None
        by_step = sorted(training.metrics, key=lambda m: m.step)
        for record, metrics in zip(records, by_step[::updates]):  # each iteration's first update: on-policy
            record.loss = metrics.loss
        return RLResult(iterations=records, training=training, rollout_failures=failures, shared_devices=shared,
                        moves=[] if sizer is None else sizer.moves)

    def _train_hybrid(self) -> RLResult:
        """Placement "hybrid": one elastic job whose every step samples, scores and trains (rl/hybrid.py);
        nothing gates its steps and nothing refits: each rank samples from the weights it trains."""
        from baige_ray.jobs.launch import launch

        source = HybridRollouts(run_name=self.run.name, prompts=self.prompts, prompt_tokens=self.prompt_tokens,
                                reward=self.reward, config=self.config,
                                tokenizer_path=str(self.model.tokenizer or self.model.path),
                                trust_remote_code=self.model.trust_remote_code,
                                eos_token_id=self.tokenizer.eos_token_id, pad_id=self.pad_id,
                                seq_len=self.model.seq_len, max_batch_size=self.rollout.max_batch_size,
                                groups_per_batch=-(-self.config.prompts_per_iteration // self.scaling.num_workers))
        job = launch(self.model, data=source, objective=PolicyObjective(loss_config=self.config.loss),
                     train=self._train_config(),
                     scaling=dataclasses.replace(self.scaling, device_share=self.shares.worker),
                     run=dataclasses.replace(self.run, show_progress=False), elastic=self.elastic,
                     layout=self.layout or "ddp", faults=self.faults)
        try:
            training, job = job.wait(), None
        finally:
            if job is not None:
                job.kill()
        return RLResult(iterations=hybrid_records(training.metrics), training=training,
                        rollout_failures=[])

    def _split_sizer(self, job) -> SplitSizer:
        spares = (self.elastic or ElasticConfig()).num_spares
        reference = self.shares.reference if self.config.loss.kl_coef > 0 else 0.0
        pool = pool_devices_for(self.rollout.sizing, ray.cluster_resources().get("GPU", 0.0), spares=spares,
                                spare_share=self.shares.worker, reference_share=reference)
        # Groups go to the replicas whole: a replica beyond one per prompt would have nothing to decode.
        return SplitSizer(self.rollout.sizing, pool_devices=pool, train_sizes=job_sizes(job.status()),
                          max_replicas=self.config.prompts_per_iteration, num_iterations=self.config.num_iterations,
                          replicas=self.rollout.num_replicas, workers=self.scaling.num_workers)

    def _size_split(self, sizer: SplitSizer, record: IterationRecord, info, job) -> None:
        """After `record`'s refit: learn its phases' times, and move devices where the policy says."""
        if record.iteration > 0:  # the first iteration's training includes the job's start
            sizer.record(record.rollout_s, record.training_s)
        decision = sizer.decide(record.iteration)
        if decision.moves_from(sizer.replicas, sizer.workers):
            move = sizer.move(record.iteration, decision, ServeReplicas(info), job)
            logger.info("rl split: replicas %s, workers %s in %.1fs: %s", move.replicas, move.workers,
                        move.seconds, move.reason)

    def _release_devices(self, info) -> float:
        """Colocated: the replicas' engines give their device memory back before training takes the
        devices; seconds (0 when split)."""
        from baige_ray.serving.app import set_replicas_asleep

        if self.rollout.placement != "colocated":
            return 0.0
        started = time.perf_counter()
        set_replicas_asleep(info, True, timeout_s=self.config.refit_timeout_s)
        return time.perf_counter() - started

    @staticmethod
    def _shared_devices(info, job) -> int:
        from baige_ray.serving.app import replica_devices

        workers = [(w["node_id"], w["device_index"]) for w in job.status()["workers"] if w["node_id"] is not None]
        return shared_devices(replica_devices(info).values(), workers)

    def _train_config(self) -> TrainConfig:
        c = self.config
        return TrainConfig(num_steps=c.num_steps, global_batch_size=c.batch_size,
                           micro_batch_size=c.micro_batch_size, learning_rate=c.learning_rate,
                           min_learning_rate=c.learning_rate, warmup_steps=0,
                           weight_decay=c.weight_decay, grad_clip=c.grad_clip, seed=c.seed)

    def _rollout(self, iteration: int, client: RolloutClient, failures: list[str],
                 split: tuple[int, int]) -> _Rollouts:
        """Iteration `iteration`'s completions from the replicas as their weights stand, scored."""
        prompts = self.config.prompt_indices(iteration, len(self.prompts))
        groups = [RolloutGroup(tuple(self.prompt_tokens[p]),
                               tuple(self._sampling(iteration, j, i) for i in range(self.config.group_size)))
                  for j, p in enumerate(prompts)]
        busy = BusyReplicas()
        injector = None
        if self.rollout_faults is not None:
            injector = self.rollout_faults.arm(iteration, busy)
        started = time.perf_counter()
        completions, stats = client.generate(groups, busy, num_replicas=split[0], max_share=self.rollout.max_batch_size)
        rollout_s = time.perf_counter() - started
        if injector is not None:
            injector.join()
        failures.extend(stats.failures)
        started = time.perf_counter()
        rewards = self._score(prompts, [completion.tokens for completion in completions])
        prompt_of_completion = [group.prompt for group in groups for _ in group.params]
        reference = self._reference_log_probs(prompt_of_completion, completions)
        record = IterationRecord(iteration=iteration, rewards=rewards, rollout_s=rollout_s,
                                 scoring_s=time.perf_counter() - started, reissued=stats.reissued,
                                 replicas=split[0], workers=split[1])
        return _Rollouts(record, prompt_of_completion, completions, reference)

    def _publish(self, rollouts: _Rollouts, board, tight: bool = False) -> IterationRecord:
        """The rollouts' advantages, packed for the training step(s) of their iteration and put on the
        board. `tight`: packed as long as the iteration's longest sample needs, not the model's seq_len (a
        job without pipeline stages, whose shapes may change from step to step)."""
        record, prompts = rollouts.record, rollouts.prompts
        advantages = group_advantages(torch.tensor(record.rewards).view(-1, self.config.group_size),
                                      scale_by_std=self.config.loss.scale_by_std).flatten().tolist()
        tokens = [completion.tokens for completion in rollouts.completions]
        length = packed_length(prompts, tokens, self.model.seq_len) if tight else self.model.seq_len
        inputs, targets = pack_rollouts(prompts, tokens, advantages, length, pad_id=self.pad_id,
                                        sampled_log_probs=[completion.log_probs for completion in rollouts.completions],
                                        ref_log_probs=rollouts.reference)
        updates = self.config.updates_per_iteration
        ray.get(board.publish.remote(record.iteration * updates, inputs, targets, steps=updates))
        return record

    def _sampling(self, iteration: int, prompt: int, sample: int) -> SamplingParams:
        return SamplingParams(max_new_tokens=self.config.max_new_tokens, temperature=self.config.temperature,
                              top_k=None, seed=self.config.sample_seed(iteration, prompt, sample), log_probs=True)

    def _reference_log_probs(self, prompts: list[tuple[int, ...]],
                             completions: list[Completion]) -> list[list[float]] | None:
        """Each completion token's log-probability under the starting weights (None without a KL penalty).
        A prompt and its completion fit the model's positions (`_check_lengths`): nothing is cut."""
        if self._reference is None:
            return None
        return ray.get(self._reference.log_probs.remote([list(p) + c.tokens for p, c in zip(prompts, completions)],
                                                        [len(p) for p in prompts]))

    def _score(self, prompts: list[int], completions: list[list[int]]) -> list[float]:
        texts = [self.prompts[prompts[index // self.config.group_size]] for index in range(len(completions))]
        return score(self.reward, texts, completions, self.tokenizer)

    # ----- the training side -----

    def _wait_for_steps(self, job, steps: int) -> dict[str, Any]:
        """Wait until the job has finished `steps` steps; its status then."""
        while (status := job.wait_for_step(steps, STEP_WAIT_S))["step"] < steps:
            if status["state"] in ("finished", "failed"):
                raise RuntimeError(f"the policy's training job ended ({status['state']}) at step {status['step']}, "
                                   f"before step {steps}: {status['events'][-1:]}")
        return status

    def _refit(self, job, info, step: int) -> float:
        """Step `step`'s weights into every rollout replica, from the job's snapshot in memory; seconds."""
        from baige_ray.serving.app import reload_weights

        state = self._state_after(job, step)
        started = time.perf_counter()
        try:
            # The job outlives its rollout replicas: they read its snapshot where it lies (no copy).
            reload_weights(info, state, model_config=self.model, timeout_s=self.config.refit_timeout_s,
                           keep_copy=False)
        except TimeoutError as error:  # a replica that did not swap in time: publish again, once
            logger.warning("weight sync of step %d stalled (%s); retrying", step, error)
            try:
                reload_weights(info, state, model_config=self.model, timeout_s=self.config.refit_timeout_s,
                               keep_copy=False)
            except TimeoutError as again:
                raise RuntimeError(f"weight sync of step {step} stalled twice: {again}") from again
        return time.perf_counter() - started

    def _state_after(self, job, step: int) -> tuple[int, Any]:
        """(step, weights ref) of the snapshot taken after `step`: it is copied beside the next step's
        start, so it may be a moment behind the step count."""
        while True:
            try:
                state = job.latest_model_state()
            except ray.exceptions.RayTaskError:  # no snapshot yet, or its members are regrouping
                state = (-1, None)
            if state[0] >= step:
                return state
            self._wait_for_steps(job, step + 1)  # raises if the job ended meanwhile
            time.sleep(SNAPSHOT_POLL_S)


def hybrid_records(metrics: Sequence[Any]) -> list[IterationRecord]:
    """A hybrid run's iterations from its steps' metrics (one step each): the phases the ranks reported
    (the slowest rank's), training the rest of the step, no refit (the weights sampled are those trained),
    and the period from the step before's results to this one's."""
    records, previous = [], None
    for step in sorted({m.step: m for m in metrics}.values(), key=lambda m: m.step):  # a redone step: its last
        drawn = step.policy_samples
        records.append(IterationRecord(
            iteration=step.step, rewards=list(drawn["rewards"]), rollout_s=drawn["rollout_s"],
            scoring_s=drawn["scoring_s"], training_s=step.step_time_s - drawn["rollout_s"] - drawn["scoring_s"],
            refit_s=0.0, loss=step.loss,
            period_s=_seconds_between(previous, step)))
        previous = step
    return records


def _seconds_between(earlier: Any, later: Any) -> float:
    if earlier is None or earlier.finished_at is None or later.finished_at is None:
        return math.nan  # the first step, or one whose results died with a worker (its time is unknown)
    return later.finished_at - earlier.finished_at
