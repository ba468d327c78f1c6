"""What a model plug-in gives serving to generate text: a decoder the engine drives and a codec.

`KVDecoder.forward(input_ids, position_ids, attention_mask, past)` takes `[rows, new]` tokens and their
positions, a `[rows, past_columns + new]` mask (0 for left padding) and the per-layer cache of the rows
so far (None to prefill), and returns the last position's logits per row (float32, CPU: sampling there
makes a seed give the same tokens on any device), or with `all_positions` every new position's
(`[rows, new, vocab]`: a prompt's log-probabilities), and the cache grown by `new` columns. A `TextCodec`
turns text into token ids and back. Each plug-in implements them for its family (models/gpt_decoding.py,
models/hf/decoding.py); the serving engine (serving/engine.py) knows only these protocols. A token is
drawn from the logits (the top-k of them where a request asks) with a generator of the row's own
(`sample_token`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F

KV = list[tuple[torch.Tensor, torch.Tensor]]  # per layer: keys and values, [rows, heads, columns, head_dim]


class KVDecoder(Protocol):
    max_context: int  # positions the model has: prompt plus new tokens must fit

    @property
    def device(self) -> torch.device:
        """Where the model, and so the cache it returns, lives."""

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, attention_mask: torch.Tensor,
                past: KV | None, *, all_positions: bool = False) -> tuple[torch.Tensor, KV]: ...


class TextCodec(Protocol):
    eos_token_id: int | None

    def encode(self, prompt: str) -> list[int]: ...

    def decoder(self, skip_special_tokens: bool = True) -> IncrementalDecoder: ...

    def chat_tokens(self, messages: tuple[tuple[str, str], ...], tools: tuple[dict, ...] | None = None) -> list[int]:
        """The prompt for (role, content) messages, ready for the assistant's answer; `tools` (OpenAI's
        function tools) for the chat template to write in."""

    def token_text(self, token: int) -> str:
        """One token decoded alone, special tokens included (how vLLM names a token in log-probabilities)."""

    def tokens_text(self, tokens: list[int]) -> str:
        """Tokens decoded together, special tokens included (a byte token read with those before it)."""


class IncrementalDecoder(Protocol):
    def push(self, token: int) -> str:
        """The text this token completes (empty while a character is still partial)."""

    def flush(self) -> str:
        """Whatever is left once the request ended; a character still partial then is dropped, as vLLM
        drops it (its last bytes were never generated)."""


def plain_chat_prompt(messages: tuple[tuple[str, str], ...]) -> str:
    """The prompt for a model whose tokenizer has no chat template: one 'role: content' line each."""
    return "".join(f"{role}: {content}\n" for role, content in messages) + "assistant:"


class TokenizerCodec:
    """A Hugging Face tokenizer (special tokens added as the model was trained, skipped in output)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.eos_token_id = tokenizer.eos_token_id

    def encode(self, prompt: str) -> list[int]:
        ids = self.tokenizer(prompt, add_special_tokens=True)["input_ids"]
        return ids or [self.tokenizer.bos_token_id or self.tokenizer.eos_token_id or 0]

    def decoder(self, skip_special_tokens: bool = True) -> IncrementalDecoder:
        return _TokenizerDecoder(self.tokenizer, skip_special_tokens)

    def token_text(self, token: int) -> str:
        return self.tokenizer.decode([token]) or ""

    def tokens_text(self, tokens: list[int]) -> str:
        return self.tokenizer.decode(tokens) or ""

    def chat_tokens(self, messages: tuple[tuple[str, str], ...], tools: tuple[dict, ...] | None = None) -> list[int]:
        if not getattr(self.tokenizer, "chat_template", None):  # e.g. a base model's tokenizer
            return self.encode(plain_chat_prompt(messages))
        conversation = [{"role": role, "content": content} for role, content in messages]
        text = self.tokenizer.apply_chat_template(conversation, tools=list(tools) if tools else None, tokenize=False,
                                                  add_generation_prompt=True)
        # The template writes the special tokens it wants (BOS included): none are added again.
        return self.tokenizer(text, add_special_tokens=False)["input_ids"] or self.encode(text)


class _TokenizerDecoder:
    """Decodes the whole output each time and hands on what is new: byte-level BPE tokens may end
    mid-character (the decode then ends in U+FFFD), and merges may change earlier characters' spacing."""

    def __init__(self, tokenizer, skip_special_tokens: bool = True):
        self._tokenizer, self._tokens, self._sent = tokenizer, [], ""
        self._skip_special_tokens = skip_special_tokens

    def push(self, token: int) -> str:
        self._tokens.append(token)
        text = self._tokenizer.decode(self._tokens, skip_special_tokens=self._skip_special_tokens)
        if text.endswith("\ufffd") or not text.startswith(self._sent):
            return ""
        delta, self._sent = text[len(self._sent):], text
        return delta

    def flush(self) -> str:
        text = self._tokenizer.decode(self._tokens, skip_special_tokens=self._skip_special_tokens).rstrip("\ufffd")  # partial: dropped
        delta = text[len(self._sent):] if text.startswith(self._sent) else ""
        self._sent = text
        return delta


@dataclass(frozen=True)
class VLLMSource:
    """What vLLM loads a model from: a directory with its config and tokenizer (the weights come from
    memory) and the context it serves."""

    model_dir: str
    max_context: int


def seeded_generator(seed: int | None) -> torch.Generator:
    generator = torch.Generator()
    if seed is None:
        generator.seed()
    else:
        generator.manual_seed(seed)
    return generator


def token_log_prob(logits: torch.Tensor, token: int) -> float:
    """log p(token) under the raw `logits` of one position (no temperature, no top-k), in fp32."""
    return float(F.log_softmax(logits.float(), dim=-1)[token])


def sample_token(logits: torch.Tensor, temperature: float, generator: torch.Generator,
                 top_k: int | None = None) -> int:
    """Argmax at temperature 0; otherwise a draw from softmax(logits / temperature), over the top-k
    logits only when `top_k` is set (None: the whole vocabulary, as vLLM samples by default).

    The draw inverts the distribution's cumulative sum (in fp64) at one uniform number from `generator`:
    torch.multinomial took 2.4 ms for one draw from a 151,936-token vocabulary on one core, this 0.4 ms,
    and a decode step samples every row of the batch this way."""
    if temperature == 0:
        return int(torch.argmax(logits))
    scaled = logits / temperature
    if top_k is not None and top_k < scaled.shape[-1]:
        kth = torch.topk(scaled, top_k).values[-1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    cumulative = torch.cumsum(F.softmax(scaled.double(), dim=-1), dim=-1)
    threshold = torch.rand((), generator=generator, dtype=torch.float64) * cumulative[-1]
    # The first token whose cumulative probability exceeds the draw: tokens of probability 0 are never it.
    return min(int(torch.searchsorted(cumulative, threshold, right=True)), scaled.shape[-1] - 1)


def sample_tokens(logits: torch.Tensor, temperature: float, generators: list[torch.Generator],
                  top_k: int | None = None) -> list[int]:
    """`sample_token` for every row of `logits` ([rows, vocab]) at once, row i drawing from generators[i]:
    the same tokens, one softmax, cumulative sum and search for the whole batch instead of one per row
    (a decode step of a tiny model spent a fifth of its time sampling row by row)."""
    if temperature == 0:
        return torch.argmax(logits, dim=-1).tolist()
    scaled = logits / temperature
    if top_k is not None and top_k < scaled.shape[-1]:
        kth = torch.topk(scaled, top_k, dim=-1).values[:, -1:]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    return draw_tokens(scaled, generators)


def draw_tokens(scaled: torch.Tensor, generators: list[torch.Generator]) -> list[int]:
    """A draw from softmax(scaled) for every row of `scaled` ([rows, vocab], already divided by the temperature
    and narrowed), row i inverting its cumulative sum (fp64) at one uniform number from generators[i]."""
    cumulative = torch.cumsum(F.softmax(scaled.double(), dim=-1), dim=-1)
    draws = torch.stack([torch.rand((), generator=generator, dtype=torch.float64) for generator in generators])
    thresholds = draws * cumulative[:, -1]
    found = torch.searchsorted(cumulative, thresholds[:, None], right=True)[:, 0]
    return found.clamp(max=scaled.shape[-1] - 1).tolist()


def tokens_log_probs(logits: torch.Tensor, tokens: list[int]) -> list[float]:
    """`token_log_prob` of tokens[i] under row i of `logits`, for every row at once."""
    chosen = torch.tensor(tokens, dtype=torch.long)[:, None]
    return F.log_softmax(logits.float(), dim=-1).gather(-1, chosen)[:, 0].tolist()
