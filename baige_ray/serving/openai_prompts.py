"""The prompts of a completions request, as vLLM takes them: a string, a list of strings, a list of
token ids, or a list of token-id lists. Each becomes a `Prompt` (text, or token ids the engine takes
as they are) and gets a choice of its own in the answer, in order (OpenAI's `index`).

Token ids are checked against the model's vocabulary where the parser knows its size: an id past it
would index outside the embedding table inside the engine. Plain Python: no Ray, no torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from baige_ray.api.validation import is_int
from baige_ray.serving.requests import bad_request, check_prompt

PROMPT_SHAPES = "a string, a list of strings, a list of token ids, or a list of token-id lists"


@dataclass(kw_only=True, frozen=True)
class Prompt:
    """One prompt: `text` to encode with the model's tokenizer, or `token_ids` to submit as they are."""

    text: str | None = None
    token_ids: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if (self.text is None) == (self.token_ids is None):
            raise ValueError(f"Prompt(text={self.text!r}, token_ids={self.token_ids!r}) is invalid: expected "
                             "exactly one of text and token_ids")


def check_token_ids(field: str, values: Any, vocab_size: int | None, *, allow_empty: bool = False) -> tuple[int, ...]:
    """`values` as token ids: a list of integers in [0, vocab_size) (any size when unknown), or a 400 naming
    `field`."""
    if not isinstance(values, list) or not all(is_int(value) for value in values):
        raise bad_request(field, f"'{field}' must be a list of token ids (integers), got {_shown(values)}")
    if not values and not allow_empty:
        raise bad_request(field, f"'{field}' must not be empty")
    outside = [value for value in values if value < 0 or (vocab_size is not None and value >= vocab_size)]
    if outside:
        limit = "" if vocab_size is None else f" (the vocabulary holds {vocab_size} tokens)"
        raise bad_request(field, f"Token id {outside[0]} in '{field}' is out of vocabulary{limit}")
    return tuple(values)


def _shown(value: Any, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def parse_prompts(value: Any, *, max_prompt_chars: int, vocab_size: int | None) -> tuple[Prompt, ...]:
    """The prompts a completions request's `prompt` holds, or a 400 naming what is wrong."""
    if value is None:
        raise bad_request("prompt", f"'prompt' is required: {PROMPT_SHAPES}")
    if isinstance(value, str):
        return (Prompt(text=check_prompt(value, max_prompt_chars)),)
    if not isinstance(value, list) or not value:
        raise bad_request("prompt", f"'prompt' must be {PROMPT_SHAPES} (not empty), got {_shown(value)}")
    if all(isinstance(item, str) for item in value):
        return tuple(Prompt(text=check_prompt(item, max_prompt_chars, f"prompt[{index}]"))
                     for index, item in enumerate(value))
    if all(is_int(item) for item in value):
        return (Prompt(token_ids=check_token_ids("prompt", value, vocab_size)),)
    if all(isinstance(item, list) for item in value):
        return tuple(Prompt(token_ids=check_token_ids(f"prompt[{index}]", item, vocab_size))
                     for index, item in enumerate(value))
    raise bad_request("prompt", f"'prompt' must be {PROMPT_SHAPES}, not a mixture, got {_shown(value)}")


def prompt_tokens(prompt: Prompt, encode) -> list[int]:
    """The prompt's token ids: its own, or its text through `encode` (the model's tokenizer)."""
    return list(prompt.token_ids) if prompt.token_ids is not None else encode(prompt.text)

