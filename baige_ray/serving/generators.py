"""Text in, text out: what a serving replica runs, whatever the model family.

A `TextGenerator` pairs the model plug-in's `KVDecoder`, which the continuous-batching engine drives,
with its `TextCodec` between text and token ids (models/generation.py): `text_generator(plugin, weights)`.
The server only sees text, token ids and events.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from baige_ray.models.generation import KVDecoder, TextCodec
from baige_ray.serving.context_length import fit_context
from baige_ray.serving.requests import GenerateRequest
from baige_ray.serving.token_logprobs import PromptLogprobs, TokenLogprobs


@dataclass(frozen=True)
class TextDelta:
    """Text as it streams, and the log-probabilities of the tokens that brought it (when the request asked
    for them: then one per token, whose text may be empty while a stop string or a character is
    incomplete); the first carries the prompt's when they were asked for."""

    text: str
    logprobs: tuple[TokenLogprobs, ...] = ()
    prompt_logprobs: PromptLogprobs | None = None
    completion_tokens: int = 0  # generated so far, this delta's included (per-chunk usage)
    token_ids: tuple[int, ...] = ()  # the tokens generated since the last delta (a tool-call parser reads them)


@dataclass(frozen=True)
class TextOutput:
    text: str
    prompt_tokens: int
    completion_tokens: int
    finish_reason: str  # "stop" (end of text or a stop string) or "length" (the token budget ran out)
    # When asked for: every token's that the request sampled (a stopping token's last), and the prompt's.
    logprobs: tuple[TokenLogprobs, ...] | None = None
    prompt_logprobs: PromptLogprobs | None = None
    token_ids: tuple[int, ...] = ()  # every generated token (a tool-call parser reads them)


@dataclass(frozen=True)
class TextGenerator:
    decoder: KVDecoder
    codec: TextCodec

    def encode(self, prompt: str) -> list[int]:
        """The prompt's tokens (they and the new tokens must fit the decoder's context)."""
        return self.codec.encode(prompt)

    def generate(self, requests: Sequence[GenerateRequest]) -> list[TextOutput]:
        """Complete requests on the calling thread, batched continuously (tests, scripts, warm-up); a
        request that does not fit the context is refused with a RequestError, as the routes refuse it."""
        from baige_ray.serving.causal_lm_generation import SamplingParams
        from baige_ray.serving.engine import ContinuousBatchingEngine, EngineLimits, generate_all

        engine = ContinuousBatchingEngine(self.decoder, eos_token_id=self.codec.eos_token_id,
                                          limits=EngineLimits(max_waiting=max(1, len(requests))))
        prompts = [fit_context(self.encode(r.prompt), max_tokens=r.max_new_tokens, max_context=self.decoder.max_context,
                               truncate_prompt_tokens=r.truncate_prompt_tokens, field="max_new_tokens")
                   for r in requests]
        params = [SamplingParams(max_new_tokens=r.max_new_tokens, temperature=r.temperature, seed=r.seed)
                  for r in requests]
        outputs = []
        for prompt, request, generation in zip(prompts, requests, generate_all(engine, prompts, params)):
            decoder = self.codec.decoder()
            text = "".join(decoder.push(token) for token in generation.tokens) + decoder.flush()
            outputs.append(TextOutput(text, len(prompt), len(generation.tokens), generation.finish_reason))
        return outputs


def text_generator(plugin: Any, weights: dict[str, torch.Tensor]) -> TextGenerator:
    """The generator of the model `plugin` (a ModelPlugin) holds, loaded with `weights` (the codec first:
    a model without a tokenizer is refused before it is built)."""
    codec = plugin.text_codec()
    return TextGenerator(plugin.build_decoder(weights), codec)
