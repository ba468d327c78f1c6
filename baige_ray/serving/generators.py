"""Text in, text out: what a serving replica runs, whatever the model family.

A model plug-in builds its `TextGenerator` from canonical weights (`build_text_generator`): the
byte-level GPT encodes prompts as UTF-8 bytes and samples without a cache (serving/sampling.py);
a Hugging Face causal LM uses its tokenizer and generates with a KV cache
(serving/causal_lm_generation.py). The server only sees `generate(requests) -> outputs`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from torch import nn

from baige_ray.serving.requests import GenerateRequest


@dataclass(frozen=True)
class TextOutput:
    text: str
    prompt_tokens: int
    completion_tokens: int
    finish_reason: str  # "stop" (end of text) or "length" (max_new_tokens reached)


class TextGenerator(Protocol):
    def generate(self, requests: Sequence[GenerateRequest]) -> list[TextOutput]: ...


class ByteGPTGenerator:
    """The reference GPT: prompts are UTF-8 bytes, the last seq_len of them fit its window."""

    def __init__(self, model: nn.Module):
        self.model = model

    def generate(self, requests: Sequence[GenerateRequest]) -> list[TextOutput]:
        from baige_ray.serving.sampling import decode_tokens, encode_prompt, generate_batch

        outputs = generate_batch(self.model, requests)
        seq_len = self.model.config.seq_len
        return [TextOutput(decode_tokens(tokens), len(encode_prompt(request.prompt, seq_len)), len(tokens), "length")
                for request, tokens in zip(requests, outputs)]


class CausalLMGenerator:
    """A Hugging Face causal LM with its tokenizer; KV-cached generation that stops at end of text."""

    def __init__(self, model: nn.Module, tokenizer, *, max_context: int):
        self.model, self.tokenizer, self.max_context = model, tokenizer, max_context

    def generate(self, requests: Sequence[GenerateRequest]) -> list[TextOutput]:
        from baige_ray.serving.causal_lm_generation import SamplingParams, fit_prompt, generate_batch

        prompts = [self._encode(request.prompt) for request in requests]
        params = [SamplingParams(max_new_tokens=request.max_new_tokens, temperature=request.temperature,
                                 seed=request.seed) for request in requests]
        generations = generate_batch(self.model, prompts, params, eos_token_id=self.tokenizer.eos_token_id,
                                     max_context=self.max_context)
        outputs = []
        for prompt, request, generation in zip(prompts, requests, generations):
            used = fit_prompt(prompt, request.max_new_tokens, self.max_context)
            text = self.tokenizer.decode(generation.tokens, skip_special_tokens=True)
            outputs.append(TextOutput(text, len(used), len(generation.tokens), generation.finish_reason))
        return outputs

    def _encode(self, prompt: str) -> list[int]:
        ids = self.tokenizer(prompt, add_special_tokens=True)["input_ids"]
        return ids or [self.tokenizer.bos_token_id or self.tokenizer.eos_token_id or 0]
