"""The JSON bodies OpenAI's API answers with, as vLLM's server shapes them: completions (one choice per
prompt, each with its `index`), chat completions, streamed chunks, the model list and errors. Plain
Python: no Ray, no torch."""

from __future__ import annotations

import json
from collections.abc import Sequence
from http import HTTPStatus

FINISH_REASONS = ("stop", "length")
# vLLM's error `type` per status; any other status gets its HTTP phrase.
_ERROR_TYPES = {400: "BadRequestError", 404: "NotFoundError", 422: "UnprocessableEntityError",
                500: "InternalServerError", 501: "NotImplementedError", 503: "ServiceUnavailableError"}


def _check_finish_reason(finish_reason: str) -> None:
    if finish_reason not in FINISH_REASONS:
        raise ValueError(f"finish_reason={finish_reason!r} is invalid: expected one of {FINISH_REASONS}")


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def completion_response(*, request_id: str, model_name: str, created: int, choices: Sequence[tuple[str, str]],
                        prompt_tokens: int, completion_tokens: int) -> dict:
    """`/v1/completions`' body: `choices` are (text, finish_reason) in prompt order; the token counts are
    every choice's together."""
    for _, finish_reason in choices:
        _check_finish_reason(finish_reason)
    return {
        "id": request_id, "object": "text_completion", "created": created, "model": model_name,
        "choices": [{"index": index, "text": text, "finish_reason": finish_reason, "logprobs": None}
                    for index, (text, finish_reason) in enumerate(choices)],
        "usage": usage(prompt_tokens, completion_tokens),
    }


def completion_chunk(*, request_id: str, model_name: str, created: int, text: str, finish_reason: str | None,
                     index: int = 0) -> dict:
    """One server-sent event of a streamed completion, for the choice `index`."""
    return {"id": request_id, "object": "text_completion", "created": created, "model": model_name,
            "choices": [{"index": index, "text": text, "finish_reason": finish_reason, "logprobs": None}]}


def chat_response(*, request_id: str, model_name: str, created: int, text: str, finish_reason: str,
                  prompt_tokens: int, completion_tokens: int) -> dict:
    _check_finish_reason(finish_reason)
    return {
        "id": request_id, "object": "chat.completion", "created": created, "model": model_name,
        "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish_reason,
                     "logprobs": None}],
        "usage": usage(prompt_tokens, completion_tokens),
    }


def chat_chunk(*, request_id: str, model_name: str, created: int, delta: dict, finish_reason: str | None,
               index: int = 0) -> dict:
    """One server-sent event of a streamed chat completion (the first carries the role)."""
    return {"id": request_id, "object": "chat.completion.chunk", "created": created, "model": model_name,
            "choices": [{"index": index, "delta": delta, "finish_reason": finish_reason, "logprobs": None}]}


def usage_chunk(*, request_id: str, model_name: str, created: int, object_name: str, prompt_tokens: int,
                completion_tokens: int) -> dict:
    """The last event when stream_options.include_usage is set: no choices, the token counts."""
    return {"id": request_id, "object": object_name, "created": created, "model": model_name, "choices": [],
            "usage": usage(prompt_tokens, completion_tokens)}


def server_sent_event(data: dict | str) -> bytes:
    payload = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"))
    return f"data: {payload}\n\n".encode()


def model_card(model_name: str, created: int, *, root: str, max_model_len: int | None) -> dict:
    """The one model this application serves, as vLLM describes it (`root`: where it was loaded from)."""
    return {"id": model_name, "object": "model", "created": created, "owned_by": "baige-ray", "root": root,
            "parent": None, "max_model_len": max_model_len, "permission": []}


def models_response(model_name: str, created: int, *, root: str, max_model_len: int | None) -> dict:
    """`GET /v1/models`."""
    return {"object": "list", "data": [model_card(model_name, created, root=root, max_model_len=max_model_len)]}


def error_body(status: int, reason: str, param: str | None = None) -> dict:
    """OpenAI's error shape as vLLM fills it; clients read `error.message` and raise by status."""
    kind = _ERROR_TYPES.get(status) or HTTPStatus(status).phrase
    return {"error": {"message": reason, "type": kind, "param": param, "code": status}}
