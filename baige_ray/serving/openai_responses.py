"""The JSON bodies OpenAI's API answers with, as vLLM's server shapes them: completions (n choices per
prompt, choice `index` = prompt index * n + sample), chat completions (n choices), streamed chunks, the
model list and errors. A choice's `logprobs` comes from openai_logprobs.py. Plain Python: no Ray, no torch."""

from __future__ import annotations

import json
from collections.abc import Sequence
from http import HTTPStatus

FINISH_REASONS = ("stop", "length", "tool_calls")
# vLLM's error `type` per status; any other status gets its HTTP phrase.
_ERROR_TYPES = {400: "BadRequestError", 404: "NotFoundError", 422: "UnprocessableEntityError",
                500: "InternalServerError", 501: "NotImplementedError", 503: "ServiceUnavailableError"}


def _check_finish_reason(finish_reason: str) -> None:
    if finish_reason not in FINISH_REASONS:
        raise ValueError(f"finish_reason={finish_reason!r} is invalid: expected one of {FINISH_REASONS}")


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def completion_choice(index: int, text: str, finish_reason: str | None, logprobs: dict | None = None) -> dict:
    if finish_reason is not None:
        _check_finish_reason(finish_reason)
    return {"index": index, "text": text, "finish_reason": finish_reason, "logprobs": logprobs}


def chat_choice(index: int, text: str, finish_reason: str, logprobs: dict | None = None) -> dict:
    return chat_message_choice(index, {"role": "assistant", "content": text}, finish_reason, logprobs)


def chat_message_choice(index: int, message: dict, finish_reason: str, logprobs: dict | None = None) -> dict:
    """A chat choice whose message is built already (one with `tool_calls`: serving/tool_calls.py)."""
    _check_finish_reason(finish_reason)
    return {"index": index, "message": message, "finish_reason": finish_reason, "logprobs": logprobs}


def completion_response(*, request_id: str, model_name: str, created: int, choices: Sequence[dict],
                        prompt_tokens: int, completion_tokens: int) -> dict:
    """`/v1/completions`' body: `choices` (completion_choice) in index order; the prompt tokens counted once
    per prompt, the completion tokens of every choice."""
    return {
        "id": request_id, "object": "text_completion", "created": created, "model": model_name,
        "choices": list(choices), "usage": usage(prompt_tokens, completion_tokens),
    }


def completion_chunk(*, request_id: str, model_name: str, created: int, text: str, finish_reason: str | None,
                     index: int = 0, logprobs: dict | None = None) -> dict:
    """One server-sent event of a streamed completion, for the choice `index`."""
    return {"id": request_id, "object": "text_completion", "created": created, "model": model_name,
            "choices": [completion_choice(index, text, finish_reason, logprobs)]}


def chat_response(*, request_id: str, model_name: str, created: int, choices: Sequence[dict],
                  prompt_tokens: int, completion_tokens: int) -> dict:
    """`/v1/chat/completions`' body: `choices` (chat_choice) in index order."""
    return {
        "id": request_id, "object": "chat.completion", "created": created, "model": model_name,
        "choices": list(choices), "usage": usage(prompt_tokens, completion_tokens),
    }


def chat_chunk(*, request_id: str, model_name: str, created: int, delta: dict, finish_reason: str | None,
               index: int = 0, logprobs: dict | None = None) -> dict:
    """One server-sent event of a streamed chat completion (the first of each choice carries the role)."""
    return {"id": request_id, "object": "chat.completion.chunk", "created": created, "model": model_name,
            "choices": [{"index": index, "delta": delta, "finish_reason": finish_reason, "logprobs": logprobs}]}


def usage_chunk(*, request_id: str, model_name: str, created: int, object_name: str, prompt_tokens: int,
                completion_tokens: int) -> dict:
    """The last event when stream_options.include_usage is set: no choices, the token counts."""
    return {"id": request_id, "object": object_name, "created": created, "model": model_name, "choices": [],
            "usage": usage(prompt_tokens, completion_tokens)}


def server_sent_event(data: dict | str) -> bytes:
    payload = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"))
    return f"data: {payload}\n\n".encode()


def model_card(model_name: str, created: int, *, root: str, max_model_len: int | None,
               parent: str | None = None) -> dict:
    """A model this application serves, as vLLM describes it (`root`: where it was loaded from; `parent`: the
    base model of an adapter)."""
    return {"id": model_name, "object": "model", "created": created, "owned_by": "baige-ray", "root": root,
            "parent": parent, "max_model_len": max_model_len, "permission": []}


def models_response(model_name: str, created: int, *, root: str, max_model_len: int | None,
                    adapters: dict[str, str] | None = None) -> dict:
    """`GET /v1/models`: the model, then each LoRA adapter (name -> where it came from) with the model as parent."""
    cards = [model_card(model_name, created, root=root, max_model_len=max_model_len)]
    cards += [model_card(name, created, root=source, max_model_len=max_model_len, parent=model_name)
              for name, source in (adapters or {}).items()]
    return {"object": "list", "data": cards}


def error_body(status: int, reason: str, param: str | None = None) -> dict:
    """OpenAI's error shape as vLLM fills it; clients read `error.message` and raise by status."""
    kind = _ERROR_TYPES.get(status) or HTTPStatus(status).phrase
    return {"error": {"message": reason, "type": kind, "param": param, "code": status}}
