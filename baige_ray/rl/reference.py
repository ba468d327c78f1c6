"""The frozen reference policy of a KL penalty: the model's starting weights, scoring the completions of
each iteration token by token.

One Ray actor per run (`start_reference`) holds the weights the policy started from (read from its
directory with the loading code serving uses: checksum-verified, no unpickling) and answers
`log_probs(sequences, starts)`: log p_ref(token) of every token of each sequence from `starts[i]` on,
given the tokens before it. It holds a device where the pool has them (a share of one, like a serving
replica) and is restarted by Ray if its process dies; a call in flight then runs again (scoring is a
pure function of its arguments).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import ray
import torch

from baige_ray.models.policy_loss import token_log_probs


class ReferencePolicy:
    def __init__(self, model_config: Any):
        from baige_ray.models.plugin import plugin_for
        from baige_ray.runtime.checkpoint_io import load_checkpoint
        from baige_ray.serving.deployment import replica_device

        torch.set_num_threads(1)  # it shares few cores with the workers and the replicas
        _, weights, _ = load_checkpoint(Path(model_config.path))
        self.device = replica_device([int(index) for index in ray.get_gpu_ids()])
        self.model = plugin_for(model_config).build_inference_model(weights).to(self.device)

    def log_probs(self, sequences: Sequence[Sequence[int]], starts: Sequence[int]) -> list[list[float]]:
        return sequence_log_probs(self.model, sequences, starts)


@torch.inference_mode()
def sequence_log_probs(model: torch.nn.Module, sequences: Sequence[Sequence[int]],
                       starts: Sequence[int]) -> list[list[float]]:
    """For each sequence, log p(sequence[j] | sequence[:j]) under the causal LM `model`, for j from
    starts[i] (>= 1) to its end: one forward over the batch."""
    check_scoring(sequences, starts)
    longest = max(len(sequence) for sequence in sequences)
    # Right padding: a causal model's logits at a token never see the padding after it.
    ids = torch.zeros((len(sequences), longest), dtype=torch.long)
    for row, sequence in enumerate(sequences):
        ids[row, : len(sequence)] = torch.tensor(list(sequence), dtype=torch.long)
    device = next(model.parameters()).device
    logits = model(input_ids=ids.to(device)).logits[:, :-1]
    scores = token_log_probs(logits, ids[:, 1:].to(device)).cpu()
    return [scores[row, start - 1 : len(sequence) - 1].tolist()
            for row, (sequence, start) in enumerate(zip(sequences, starts))]


def check_scoring(sequences: Sequence[Sequence[int]], starts: Sequence[int]) -> None:
    if not sequences or len(sequences) != len(starts):
        raise ValueError(f"got {len(sequences)} sequences and {len(starts)} starts: expected one start per "
                         "sequence, at least one sequence")
    for sequence, start in zip(sequences, starts):
        if not 1 <= start <= len(sequence):
            raise ValueError(f"start {start} is invalid for a sequence of {len(sequence)} tokens: expected "
                             "1 <= start <= its length (the first token has no prediction)")


def start_reference(run_name: str, model_config: Any, device_share: float) -> ray.actor.ActorHandle:
    """The run's reference policy, holding `device_share` of a device where the pool has them."""
    from baige_ray.serving.app import default_actor_options

    options = default_actor_options(device_share)
    return ray.remote(ReferencePolicy).options(
        name=f"baige-reference:{run_name}", max_restarts=-1, max_task_retries=-1, **options,
    ).remote(model_config)
