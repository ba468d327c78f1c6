"""vLLM's `/tokenize` and `/detokenize`, and the chat template as a request's prompt, without Ray or torch.

`/tokenize` takes `{"prompt": str}` (special tokens added as for a completion) or `{"messages": [...]}`
(through the chat template, ready for the assistant's answer) and answers
`{"count": n, "max_model_len": m, "tokens": [...]}`; `/detokenize` takes `{"tokens": [...]}` and answers
`{"prompt": str}`. Evaluation harnesses count prompt tokens with them.
"""

from __future__ import annotations

from typing import Any

from baige_ray.serving.openai_api import CompletionLimits, check_model
from baige_ray.serving.openai_chat import parse_messages
from baige_ray.serving.openai_prompts import check_token_ids
from baige_ray.serving.openai_tools import parse_tools
from baige_ray.serving.requests import bad_request, decode_json_object, ignore_unknown_fields

TOKENIZE_FIELDS = ("model", "prompt", "messages", "add_special_tokens", "add_generation_prompt", "return_token_strs",
                   "tools")
DETOKENIZE_FIELDS = ("model", "tokens")


def chat_prompt_tokens(codec: Any, messages: tuple[tuple[str, str], ...],
                       tools: tuple[dict, ...] | None = None) -> list[int]:
    """The messages (and `tools`, openai_tools.py) through the model's chat template; a 400 when the template
    cannot render them (it may refuse a role, or an order of roles), as vLLM answers a template error."""
    try:
        return codec.chat_tokens(messages, tools)
    except Exception as error:
        if not any(kind.__name__ == "TemplateError" for kind in type(error).__mro__):  # jinja2's, not imported
            raise
        raise bad_request("messages", f"the model's chat template cannot render these messages: {error}") from None


def tokenize_response(body: bytes, limits: CompletionLimits, codec: Any, *, model_name: str) -> dict:
    """`POST /tokenize`'s answer, or a RequestError naming what is wrong."""
    payload = decode_json_object(body, limits.max_body_bytes)
    ignore_unknown_fields(payload, TOKENIZE_FIELDS, "tokenize")
    check_model(payload, model_name)
    if payload.get("messages") is not None:
        # The template renders the tools; a tool choice means nothing to a count of tokens (vLLM's takes none).
        tools = parse_tools({"tools": payload.get("tools")}, parses_tool_calls=True)
        tokens = chat_prompt_tokens(codec, parse_messages(payload, limits), tools)
    elif isinstance(payload.get("prompt"), str):
        prompt = payload["prompt"]
        if len(prompt) > limits.max_prompt_chars:
            raise bad_request("prompt", f"'prompt' holds {len(prompt)} characters, more than "
                                        f"{limits.max_prompt_chars}")
        tokens = codec.encode(prompt)
    else:
        raise bad_request("prompt", "send 'prompt' (a string) or 'messages' (a list of {role, content} objects)")
    return {"count": len(tokens), "max_model_len": limits.max_context, "tokens": list(tokens)}


def detokenize_response(body: bytes, limits: CompletionLimits, codec: Any, *, model_name: str) -> dict:
    """`POST /detokenize`'s answer, or a RequestError naming what is wrong."""
    payload = decode_json_object(body, limits.max_body_bytes)
    ignore_unknown_fields(payload, DETOKENIZE_FIELDS, "detokenize")
    check_model(payload, model_name)
    if payload.get("tokens") is None:
        raise bad_request("tokens", "'tokens' is required: a list of token ids")
    tokens = check_token_ids("tokens", payload["tokens"], limits.vocab_size, allow_empty=True)
    decoder = codec.decoder()
    return {"prompt": "".join(decoder.push(token) for token in tokens) + decoder.flush()}
