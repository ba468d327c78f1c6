"""OpenAI-compatible `/v1/completions`: parse a request body as vLLM's OpenAI server reads it, without Ray or
torch. Chat is in openai_chat.py, the response shapes in openai_responses.py.

Fields the server does not know are ignored, as vLLM ignores them, and a JSON null means the field's
default. Every field vLLM's server knows is parsed into the request, at any value vLLM accepts (and
`logprobs` up to the server's `max_logprobs`, 20 as on vLLM; `max_tokens: 0` with `echo`); what an engine
refuses at the value asked for is answered by the replica with a 400 naming the field
(sampling_params.py), never silently sampled another way. A few fields vLLM knows and this server does
not implement at all (`suffix`, beam search, prompt embeddings) are refused here when
set. Every refusal is a `RequestError` carrying the HTTP status (400, as vLLM; 404
for another model; 413 for a body too large) and the field at fault.
"""

from __future__ import annotations

from dataclasses import dataclass

from baige_ray.serving.completion_limits import CompletionLimits  # noqa: F401  (imported from here by callers)
from baige_ray.serving.openai_prompts import Prompt, parse_prompts
from baige_ray.serving.openai_sampling import completion_logprobs, optional, parse_sampling
from baige_ray.serving.requests import (
    RequestError,
    bad_request,
    check_token_count,
    decode_json_object,
    ignore_unknown_fields,
    is_int,
    truncate_prompt_tokens_of,
)
from baige_ray.serving.sampling_params import SamplingParams
from baige_ray.serving.stop_strings import StopScanner, apply_stop  # noqa: F401  (imported from here by callers)

DEFAULT_MAX_TOKENS = 16  # OpenAI's and vLLM's, for completions
COMMON_FIELDS = (
    "model", "max_tokens", "temperature", "top_p", "top_k", "min_p", "n", "stream", "stream_options", "stop",
    "stop_token_ids", "seed", "user", "logprobs", "presence_penalty", "frequency_penalty", "repetition_penalty",
    "logit_bias", "min_tokens", "ignore_eos", "include_stop_str_in_output", "truncate_prompt_tokens",
    "use_beam_search", "structured_outputs", "response_format", "skip_special_tokens",
)
COMPLETION_FIELDS = COMMON_FIELDS + ("prompt", "echo", "suffix", "prompt_embeds")
# Fields vLLM knows whose effect this server does not implement: refused when set (not null, not the default);
# the serving guide's table of fields (openai_fields.py) marks them.
UNIMPLEMENTED = (
    ("suffix", lambda value: value is not None),
    ("prompt_embeds", lambda value: value is not None),
    ("use_beam_search", lambda value: value not in (None, False)),
)


@dataclass(frozen=True)
class UsageOptions:
    """Where a stream reports token counts (stream_options): a last chunk of them (include_usage), and each
    chunk its choice's counts so far (continuous_usage_stats, which vLLM heeds only with include_usage)."""

    at_end: bool = False
    every_chunk: bool = False


@dataclass(kw_only=True, frozen=True)
class CompletionRequest:
    prompts: tuple[Prompt, ...]  # n choices each, in order
    max_tokens: int  # 0 with echo: the prompt alone is answered (one token is generated, as vLLM does)
    sampling: SamplingParams  # max_new_tokens = max_tokens
    stream: bool = False
    usage: UsageOptions = UsageOptions()  # stream_options: where token counts are reported
    truncate_prompt_tokens: int | None = None  # keep only the prompt's last k tokens (vLLM's extension)


def check_model(payload: dict, model_name: str, adapters: tuple[str, ...] = ()) -> str | None:
    """The adapter the request's `model` names (None: the model itself, or no `model`): an adapter is
    named alone or as `<model>:<adapter>` (Ray Serve LLM's form); anything else is a 404."""
    model = payload.get("model")
    if model is None or model == model_name:
        return None
    adapter = model.removeprefix(f"{model_name}:") if isinstance(model, str) else None
    if adapter not in adapters:
        raise RequestError(404, f"The model `{model}` does not exist.", param="model")
    return adapter


def refuse_unimplemented(payload: dict) -> None:
    for field, is_set in UNIMPLEMENTED:
        if field in payload and is_set(payload[field]):
            raise bad_request(field, f"'{field}' is not yet implemented by this server: omit it or send null")


def parse_max_tokens(payload: dict, limits: CompletionLimits, field: str, default: int | None) -> int | None:
    """`payload[field]`: at least 1 and at most the model's context (where known); `default` when null."""
    value = payload.get(field)
    if value is None:
        return default
    count = check_token_count(field, value, None)
    if limits.max_context is not None and count > limits.max_context:
        raise bad_request(field, f"{field}={count} cannot be greater than max_model_len={limits.max_context}. "
                                 "Please request fewer output tokens.")
    return count


def parse_stream(payload: dict) -> tuple[bool, UsageOptions]:
    """(stream, usage options) from 'stream' and 'stream_options' (whose other keys are ignored)."""
    stream = optional(payload, "stream", "bool", False)
    options = payload.get("stream_options")
    if options is None:
        return stream, UsageOptions()
    if not stream:
        raise bad_request("stream_options", "'stream_options' can only be defined when 'stream' is true")
    if not isinstance(options, dict):
        raise bad_request("stream_options", f"'stream_options' must be an object, got {options!r}")
    flags = {}
    for key in ("include_usage", "continuous_usage_stats"):
        value = options.get(key)
        if value is not None and not isinstance(value, bool):
            raise bad_request("stream_options", f"'stream_options.{key}' must be true or false, got {value!r}")
        flags[key] = bool(value)
    at_end = flags["include_usage"]
    return True, UsageOptions(at_end=at_end, every_chunk=at_end and flags["continuous_usage_stats"])


def check_user(payload: dict) -> None:
    user = payload.get("user")
    if user is not None and not isinstance(user, str):
        raise bad_request("user", f"'user' must be a string, got {type(user).__name__}")


def parse_completion_request(body: bytes, limits: CompletionLimits, *, model_name: str,
                             adapters: tuple[str, ...] = ()) -> CompletionRequest:
    """The validated completion request in `body`, or a RequestError naming what is wrong."""
    payload = decode_json_object(body, limits.max_body_bytes)
    ignore_unknown_fields(payload, COMPLETION_FIELDS, "v1/completions")
    adapter = check_model(payload, model_name, adapters)
    refuse_unimplemented(payload)
    check_user(payload)
    prompts = parse_prompts(payload.get("prompt"), max_prompt_chars=limits.max_prompt_chars,
                            vocab_size=limits.vocab_size)
    echo = optional(payload, "echo", "bool", False)
    echo_only = echo and payload.get("max_tokens") == 0 and is_int(payload["max_tokens"])
    max_tokens = 0 if echo_only else parse_max_tokens(payload, limits, "max_tokens", DEFAULT_MAX_TOKENS)
    sampling = parse_sampling(payload, limits, max_new_tokens=max_tokens, num_logprobs=completion_logprobs(payload),
                              echo=echo, adapter=adapter)
    stream, usage = parse_stream(payload)
    return CompletionRequest(prompts=prompts, max_tokens=max_tokens, sampling=sampling, stream=stream, usage=usage,
                             truncate_prompt_tokens=truncate_prompt_tokens_of(payload))

