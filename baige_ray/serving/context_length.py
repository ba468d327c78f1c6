"""Whether a prompt and its new tokens fit the model's context, and how many new tokens a request gets.

`/generate` refuses a prompt whose tokens plus the tokens asked for exceed the model's context (HTTP 400).
The OpenAI routes follow vLLM's server (`openai_budget`): the prompt must leave room for one new token,
and a `max_tokens` beyond the rest of the context generates up to its end ("length"). A prompt is
never cut silently: a shortened prompt answers a question the client did not ask. A client that
prefers the prompt's end to an error says so with vLLM's `truncate_prompt_tokens=k`: the prompt
keeps its last k tokens (k=-1: as many as fit), and must then fit like any other. The engines refuse
what does not fit (`require_fit`, a ValueError) rather than cut it, so this replica-side check is the
only place a prompt is ever shortened. A request that sets no budget (a chat without max_tokens) may
generate up to the rest of the context, as vLLM allows. Plain integers: no Ray, no torch.
"""

from __future__ import annotations

from collections.abc import Sequence

from baige_ray.serving.requests import bad_request


def _context_sentence(max_context: int, limit: str | None) -> str:
    """The first sentence of a refusal: the model's context, or why the replica holds less (`limit`)."""
    return f"{limit}." if limit else f"This model's maximum context length is {max_context} tokens."


def overflow_reason(prompt_tokens: int, max_tokens: int, max_context: int, *, field: str = "max_tokens",
                    limit: str | None = None) -> str | None:
    """Why `prompt_tokens` plus `max_tokens` new ones do not fit `max_context`, or None when they do. `limit`:
    why the replica's context is below the model's (its KV memory budget), said instead of the model's."""
    if prompt_tokens + max_tokens <= max_context:
        return None
    return (f"{_context_sentence(max_context, limit)} However, you requested "
            f"{prompt_tokens + max_tokens} tokens: {prompt_tokens} in the prompt and {field}={max_tokens} to "
            f"generate. Shorten the prompt, lower {field}, or send truncate_prompt_tokens to keep only the "
            "prompt's last tokens")


def require_fit(prompt_tokens: int, max_tokens: int, max_context: int) -> None:
    """What an engine checks on submit: a ValueError naming the numbers, instead of cutting the prompt."""
    reason = overflow_reason(prompt_tokens, max_tokens, max_context, field="max_new_tokens")
    if reason is not None:
        raise ValueError(reason)


def _truncated(prompt: Sequence[int], truncate_prompt_tokens: int, max_tokens: int | None,
               max_context: int) -> Sequence[int]:
    keep = max_context - (1 if max_tokens is None else max_tokens) if truncate_prompt_tokens == -1 \
        else truncate_prompt_tokens
    if truncate_prompt_tokens > max_context or keep < 1:
        raise bad_request("truncate_prompt_tokens",
                          f"'truncate_prompt_tokens'={truncate_prompt_tokens} leaves no prompt within the model's "
                          f"context of {max_context} tokens" + (f" and max_tokens={max_tokens}" if keep < 1 else ""))
    return prompt[-keep:]


def fit_context(prompt: Sequence[int], *, max_tokens: int | None, max_context: int,
                truncate_prompt_tokens: int | None = None, field: str = "max_tokens",
                limit: str | None = None) -> list[int]:
    """The prompt a replica submits: its last `truncate_prompt_tokens` tokens when that is set, else all
    of it. A 400 when the truncation exceeds the context, or the prompt and `max_tokens` (the request's
    `field`; None: at least one new token) do not fit it."""
    if truncate_prompt_tokens is not None:
        prompt = _truncated(prompt, truncate_prompt_tokens, max_tokens, max_context)
    if max_tokens is None and len(prompt) >= max_context:
        raise bad_request("prompt", f"{_context_sentence(max_context, limit)} However, your "
                                    f"prompt contains {len(prompt)} input tokens, which leaves no room to generate. "
                                    "Shorten the prompt, or send truncate_prompt_tokens")
    reason = overflow_reason(len(prompt), 0 if max_tokens is None else max_tokens, max_context, field=field,
                             limit=limit)
    if reason is not None:
        raise bad_request(field, reason)
    return list(prompt)


def new_token_budget(prompt_tokens: int, max_tokens: int | None, max_context: int) -> int:
    """How many tokens a fitted prompt may generate: `max_tokens` or the rest of the context, whichever is less."""
    rest = max_context - prompt_tokens
    return rest if max_tokens is None else min(max_tokens, rest)


def openai_budget(prompt: Sequence[int], *, max_tokens: int | None, max_context: int,
                  truncate_prompt_tokens: int | None = None, limit: str | None = None) -> tuple[list[int], int]:
    """(the prompt to submit, how many tokens it may generate) as vLLM's OpenAI server decides them: the
    prompt (its last `truncate_prompt_tokens`; -1: as many as leave room for `max_tokens`) must leave the
    context room for one new token, else a 400; it then generates up to `max_tokens` or the end of the context."""
    room_for = max_tokens if truncate_prompt_tokens == -1 else None
    fitted = fit_context(prompt, max_tokens=room_for, max_context=max_context,
                         truncate_prompt_tokens=truncate_prompt_tokens, limit=limit)
    return fitted, new_token_budget(len(fitted), max_tokens, max_context)
