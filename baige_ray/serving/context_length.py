"""Whether a prompt and its new tokens fit the model's context, decided as OpenAI and vLLM decide it.

A prompt whose tokens plus the tokens asked for exceed the model's context is refused (HTTP 400),
never cut: a silently shortened prompt answers a question the client did not ask. A client that
prefers the prompt's end to an error says so with vLLM's `truncate_prompt_tokens=k`: the prompt
keeps its last k tokens, and must then fit like any other. The engines refuse what does not fit
(`require_fit`, a ValueError) rather than cut it, so this replica-side check is the only place a
prompt is ever shortened. Plain integers: no Ray, no torch.
"""

from __future__ import annotations

from collections.abc import Sequence

from baige_ray.serving.requests import RequestError


def overflow_reason(prompt_tokens: int, max_tokens: int, max_context: int, *, field: str = "max_tokens") -> str | None:
    """Why `prompt_tokens` plus `max_tokens` new ones do not fit `max_context`, or None when they do."""
    if prompt_tokens + max_tokens <= max_context:
        return None
    return (f"the model's context holds {max_context} tokens, but this request needs {prompt_tokens + max_tokens}: "
            f"{prompt_tokens} in the prompt and {field}={max_tokens} to generate. Shorten the prompt, lower "
            f"{field}, or send truncate_prompt_tokens to keep only the prompt's last tokens")


def require_fit(prompt_tokens: int, max_tokens: int, max_context: int) -> None:
    """What an engine checks on submit: a ValueError naming the numbers, instead of cutting the prompt."""
    reason = overflow_reason(prompt_tokens, max_tokens, max_context, field="max_new_tokens")
    if reason is not None:
        raise ValueError(reason)


def fit_context(prompt: Sequence[int], *, max_tokens: int, max_context: int, truncate_prompt_tokens: int | None = None,
                field: str = "max_tokens") -> list[int]:
    """The prompt a replica submits: its last `truncate_prompt_tokens` tokens when that is set, else all
    of it. A RequestError when the truncation exceeds the context (422) or the prompt and `max_tokens`
    (the request's `field`) do not fit it (400)."""
    if truncate_prompt_tokens is not None:
        if truncate_prompt_tokens > max_context:
            raise RequestError(422, f"'truncate_prompt_tokens'={truncate_prompt_tokens} is more than the model's "
                                    f"context of {max_context} tokens")
        prompt = prompt[-truncate_prompt_tokens:]
    reason = overflow_reason(len(prompt), max_tokens, max_context, field=field)
    if reason is not None:
        raise RequestError(400, reason)
    return list(prompt)
