"""Text in, text out: what a serving replica runs, whatever the model family.

A model plug-in builds its `TextGenerator` from canonical weights (`build_text_generator`): a
`KVDecoder` (serving/decoders.py) that the continuous-batching engine drives, and a `TextCodec`
between text and token ids. The byte-level GPT's codec is UTF-8 bytes; a Hugging Face causal LM's
is its tokenizer. The server only sees text, token ids and events.
"""

from __future__ import annotations

import codecs
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from baige_ray.serving.context_length import fit_context
from baige_ray.serving.decoders import KVDecoder
from baige_ray.serving.requests import GenerateRequest


@dataclass(frozen=True)
class TextOutput:
    text: str
    prompt_tokens: int
    completion_tokens: int
    finish_reason: str  # "stop" (end of text or a stop string) or "length" (the token budget ran out)


class TextCodec(Protocol):
    eos_token_id: int | None

    def encode(self, prompt: str) -> list[int]: ...

    def decoder(self) -> IncrementalDecoder: ...

    def chat_tokens(self, messages: tuple[tuple[str, str], ...]) -> list[int]:
        """The prompt for (role, content) messages, ready for the assistant's answer."""


class IncrementalDecoder(Protocol):
    def push(self, token: int) -> str:
        """The text this token completes (empty while a character is still partial)."""

    def flush(self) -> str:
        """Whatever is left once the request ended (partial characters as U+FFFD)."""


class ByteCodec:
    """The reference GPT's: tokens are the prompt's UTF-8 bytes; no end-of-text token."""

    eos_token_id = None

    def encode(self, prompt: str) -> list[int]:
        return list(prompt.encode("utf-8"))

    def decoder(self) -> IncrementalDecoder:
        return _ByteDecoder()

    def chat_tokens(self, messages: tuple[tuple[str, str], ...]) -> list[int]:
        from baige_ray.serving.openai_chat import plain_chat_prompt

        return self.encode(plain_chat_prompt(messages))


class _ByteDecoder:
    def __init__(self) -> None:
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token: int) -> str:
        return self._utf8.decode(bytes([token]))

    def flush(self) -> str:
        return self._utf8.decode(b"", final=True)


class TokenizerCodec:
    """A Hugging Face tokenizer (special tokens added as the model was trained, skipped in output)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.eos_token_id = tokenizer.eos_token_id

    def encode(self, prompt: str) -> list[int]:
        ids = self.tokenizer(prompt, add_special_tokens=True)["input_ids"]
        return ids or [self.tokenizer.bos_token_id or self.tokenizer.eos_token_id or 0]

    def decoder(self) -> IncrementalDecoder:
        return _TokenizerDecoder(self.tokenizer)

    def chat_tokens(self, messages: tuple[tuple[str, str], ...]) -> list[int]:
        from baige_ray.serving.openai_chat import plain_chat_prompt

        if not getattr(self.tokenizer, "chat_template", None):  # e.g. a base model's tokenizer
            return self.encode(plain_chat_prompt(messages))
        conversation = [{"role": role, "content": content} for role, content in messages]
        text = self.tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)
        # The template writes the special tokens it wants (BOS included): none are added again.
        return self.tokenizer(text, add_special_tokens=False)["input_ids"] or self.encode(text)


class _TokenizerDecoder:
    """Decodes the whole output each time and hands on what is new: byte-level BPE tokens may end
    mid-character (the decode then ends in U+FFFD), and merges may change earlier characters' spacing."""

    def __init__(self, tokenizer):
        self._tokenizer, self._tokens, self._sent = tokenizer, [], ""

    def push(self, token: int) -> str:
        self._tokens.append(token)
        text = self._tokenizer.decode(self._tokens, skip_special_tokens=True)
        if text.endswith("\ufffd") or not text.startswith(self._sent):
            return ""
        delta, self._sent = text[len(self._sent):], text
        return delta

    def flush(self) -> str:
        text = self._tokenizer.decode(self._tokens, skip_special_tokens=True)
        delta = text[len(self._sent):] if text.startswith(self._sent) else ""
        self._sent = text
        return delta


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
