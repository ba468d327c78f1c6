"""A long prompt prefilled a chunk per engine step, the running rows decoding between its chunks.

Prefilled whole, a prompt of thousands of tokens holds one engine step for as long as its forward runs,
and every request decoding beside it (or waiting behind it for its first token) waits that long. vLLM
bounds the tokens one step runs (`max_num_batched_tokens`: a token for each decoding row plus a piece of a
prompt). The built-in engine, with `EngineLimits.max_num_batched_tokens`, prefills a prompt longer than that
in chunks, each taking what the step's budget leaves after a token of each decoding row and the shorter
prompts (each within the budget) it prefilled whole; a step that admits many short prompts at once can
therefore run more tokens than the budget, which vLLM would spread over steps. Each chunk attends
to the keys and values of the chunks before it, exactly as the whole prompt's forward would (the numbers
differ in the last bits: the products are shaped differently).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from baige_ray.models.generation import KV, KVDecoder


@dataclass
class ChunkedPrefill:
    """One prompt's group of requests being prefilled: `done` leading tokens have their keys and values in
    `past` (a cached prefix counts). `scored`: the group asked for the prompt's log-probabilities, so every
    position's logits are kept."""

    requests: list[Any]
    prompt: list[int]
    done: int
    past: KV | None
    scored: bool = False
    _scored_logits: list[torch.Tensor] = field(default_factory=list)

    def advance(self, decoder: KVDecoder, max_tokens: int) -> tuple[torch.Tensor, KV] | None:
        """Run the next `max_tokens` (at least 1) of the prompt through `decoder`; once the whole prompt has
        run, (logits, cache) as a whole prefill gives them: the last position's logits, or every position's
        when scored, and the keys and values of every token."""
        end = min(len(self.prompt), self.done + max(1, max_tokens))
        tokens = torch.tensor([self.prompt[self.done:end]], dtype=torch.long)
        logits, self.past = decoder.forward(tokens, torch.arange(self.done, end)[None, :],
                                            torch.ones(1, end, dtype=torch.long), self.past,
                                            **({"all_positions": True} if self.scored else {}))
        if self.scored:
            self._scored_logits.append(logits)
        self.done = end
        if end < len(self.prompt):
            return None
        return (torch.cat(self._scored_logits, dim=1) if self.scored else logits), self.past
