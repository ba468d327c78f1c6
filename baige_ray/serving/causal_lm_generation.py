"""Greedy and sampled generation for Hugging Face causal LMs, batched by prompt length.

Works with any `transformers` causal LM with the Llama-family interface:
`model(input_ids=..., past_key_values=..., use_cache=...)` returning `.logits` and
`.past_key_values`.

No padding mask is built, so prompts of different lengths cannot share a forward pass without
changing each other's results. A batch is split into groups of equal prompt length (as in
`baige_ray.models.generation`); each row samples with its own generator, so a request's tokens do
not depend on what it was batched with (up to floating-point summation order).

With `use_cache=True` a group runs one prefill forward over its prompts, then one forward per new
token over only the newest token, reusing the KV cache the model returns (a transformers
`DynamicCache`). `use_cache=False` re-runs the whole sequence for every token: the reference the
cached path is tested against.

Prompt plus new tokens must fit the model's positions (`max_context`), as in the engines: a batch
holding a prompt that does not is refused with a ValueError, never cut (serving/context_length.py).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch

from baige_ray.api.validation import require_int
from baige_ray.models.generation import seeded_generator
from baige_ray.models.hf.decoding import forward_options
from baige_ray.serving.context_length import require_fit
from baige_ray.serving.row_sampling import sample_rows
from baige_ray.serving.sampling_params import SamplingParams, stops_at

# SamplingParams lives in sampling_params.py; callers import it from here too.
__all__ = ["FinishReason", "Generation", "SamplingParams", "generate_batch"]

FinishReason = Literal["stop", "length"]


@dataclass(kw_only=True, frozen=True)
class Generation:
    """New tokens of one request; an eos token that stopped it is not included. `log_probs` (when the
    request asked for them): one per token sampled, the stopping eos token's last."""

    tokens: list[int]
    finish_reason: FinishReason
    log_probs: list[float] | None = None


def _last_logits(model: Any, input_ids: torch.Tensor, past: Any, options: dict[str, Any]) -> tuple[torch.Tensor, Any]:
    outputs = model(input_ids=input_ids, past_key_values=past, **options)
    # Sampling on the CPU makes a seed give the same tokens whichever device holds the model.
    logits = outputs.logits[:, -1, :].float().cpu()
    return logits, outputs.past_key_values if options["use_cache"] else None


@dataclass(kw_only=True)
class _Row:
    params: SamplingParams
    generator: torch.Generator
    prompt: list[int]
    tokens: list[int]
    finish_reason: FinishReason | None = None
    last_token: int = 0

    @property
    def sampled(self) -> list[int]:  # the output so far, for penalties and min_tokens (row_sampling.py)
        return self.tokens


def _advance(row: _Row, logits: torch.Tensor, eos_token_id: int | None) -> None:
    (sampled,) = sample_rows(logits[None], [row], eos_token_id)
    token = sampled.token
    row.last_token = token
    if stops_at(row.params, token, eos_token_id):
        row.finish_reason = "stop"
        return
    row.tokens.append(token)
    if len(row.tokens) >= row.params.max_new_tokens:
        row.finish_reason = "length"


def _generate_group(
    model: Any, prompts: list[list[int]], rows: list[_Row], eos_token_id: int | None, options: dict[str, Any]
) -> None:
    """Fill `rows` (whose prompts have the same length) with new tokens until every row has stopped."""
    device = model.device
    step_input = torch.tensor(prompts, dtype=torch.long, device=device)
    past = None
    while True:
        logits, past = _last_logits(model, step_input, past, options)
        for index, row in enumerate(rows):
            if row.finish_reason is None:
                _advance(row, logits[index], eos_token_id)
        if all(row.finish_reason is not None for row in rows):
            return
        # Stopped rows keep feeding their last token so the batch keeps its shape; their outputs are ignored.
        column = torch.tensor([[row.last_token] for row in rows], dtype=torch.long, device=device)
        step_input = column if options["use_cache"] else torch.cat([step_input, column], dim=1)


def _check_inputs(prompts: Sequence[list[int]], requests: Sequence[SamplingParams], max_context: int) -> None:
    if len(prompts) != len(requests):
        raise ValueError(f"got {len(prompts)} prompts but {len(requests)} sampling params: expected one per prompt")
    require_int("generate_batch", "max_context", max_context, minimum=2)
    empty = [index for index, prompt in enumerate(prompts) if len(prompt) == 0]
    if empty:
        raise ValueError(f"prompts {empty} are empty: every prompt needs at least one token")
    for prompt, params in zip(prompts, requests):
        require_fit(len(prompt), params.max_new_tokens, max_context)


@torch.inference_mode()
def generate_batch(
    model: Any,
    prompts: Sequence[list[int]],
    requests: Sequence[SamplingParams],
    *,
    eos_token_id: int | None,
    max_context: int,
    use_cache: bool = True,
) -> list[Generation]:
    """New tokens for each prompt, in prompt order; `requests[i]` says how prompt i samples."""
    _check_inputs(prompts, requests, max_context)
    model.eval()
    options = forward_options(model, use_cache)
    rows = [_Row(params=params, generator=seeded_generator(params.seed), prompt=list(prompt), tokens=[])
            for prompt, params in zip(prompts, requests)]
    groups: dict[int, list[int]] = defaultdict(list)
    for index, prompt in enumerate(prompts):
        groups[len(prompt)].append(index)
    for indices in groups.values():
        _generate_group(model, [list(prompts[i]) for i in indices], [rows[i] for i in indices], eos_token_id, options)
    return [Generation(tokens=row.tokens, finish_reason=row.finish_reason) for row in rows]
