"""The sampling fields of OpenAI's completions and chat requests (with vLLM's extensions), parsed into a
`SamplingParams`: each field's JSON type checked here, its range by SamplingParams itself, and any
refusal a 400 naming the request's field. A null or absent field takes its neutral default. Which
engine implements which field is decided later, by the replica (`sampling_params.unsupported_field`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from typing import TYPE_CHECKING, Any

from baige_ray.api.validation import is_int, is_number
from baige_ray.serving.openai_prompts import check_token_ids
from baige_ray.serving.requests import bad_request, seed_of
from baige_ray.serving.sampling_params import MAX_LOGIT_BIAS, SamplingParamError, SamplingParams
from baige_ray.serving.structured_output import parse_structured_output

if TYPE_CHECKING:
    from baige_ray.serving.completion_limits import CompletionLimits

DEFAULT_TEMPERATURE = 1.0
_KINDS = {"number": (is_number, "a number"), "int": (is_int, "an integer"),
          "bool": (lambda value: isinstance(value, bool), "true or false")}
_NEUTRAL_NUMBERS = {"top_p": 1.0, "min_p": 0.0, "presence_penalty": 0.0, "frequency_penalty": 0.0,
                    "repetition_penalty": 1.0}


def optional(payload: dict, field: str, kind: str, default: Any) -> Any:
    """`payload[field]` checked to be of `kind` ("number", "int", "bool"), or `default` when absent or null."""
    value = payload.get(field)
    if value is None:
        return default
    accepts, expected = _KINDS[kind]
    if not accepts(value):
        raise bad_request(field, f"'{field}' must be {expected}, got {value!r}")
    return _as_float(field, value) if kind == "number" else value


def _as_float(field: str, value: int | float) -> float:
    try:
        return float(value)
    except OverflowError:  # an integer JSON may hold but no float can
        raise bad_request(field, f"'{field}' is too large: {value!r}") from None


def _temperature(payload: dict, limits: CompletionLimits) -> float:
    value = optional(payload, "temperature", "number", None)
    if value is None:
        return min(DEFAULT_TEMPERATURE, limits.max_temperature)
    if not math.isfinite(value):
        raise bad_request("temperature", f"'temperature' must be a finite number, got {value!r}")
    if not 0 <= value <= limits.max_temperature:
        raise bad_request("temperature",
                          f"'temperature'={value} is out of range: expected 0 to {limits.max_temperature}")
    return float(value)


def _top_k(payload: dict) -> int | None:
    value = optional(payload, "top_k", "int", 0)
    if value < -1:
        raise bad_request("top_k", f"'top_k' must be 0 or -1 (disable), or at least 1, got {value}")
    return value if value >= 1 else None


def _stop(payload: dict) -> tuple[str, ...]:
    value = payload.get("stop")
    if value is None:
        return ()
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(stop, str) for stop in stops):
        raise bad_request("stop", f"'stop' must be a string or a list of strings, got {value!r}")
    if "" in stops:
        raise bad_request("stop", "'stop' strings must not be empty")
    return tuple(dict.fromkeys(stops))  # in order, once each


def _stop_token_ids(payload: dict, vocab_size: int | None) -> tuple[int, ...]:
    value = payload.get("stop_token_ids")
    if value is None:
        return ()
    return tuple(dict.fromkeys(check_token_ids("stop_token_ids", value, vocab_size, allow_empty=True)))


def _logit_bias(payload: dict, vocab_size: int | None) -> tuple[tuple[int, float], ...]:
    """{token id (a string, as JSON keys are): bias}, clamped to [-100, 100] as vLLM and OpenAI do."""
    value = payload.get("logit_bias")
    if value is None:
        return ()
    if not isinstance(value, dict) or not all(is_number(bias) for bias in value.values()):
        raise bad_request("logit_bias", f"'logit_bias' must map token ids to numbers, got {value!r}")
    biases = [_as_float("logit_bias", bias) for bias in value.values()]
    if not all(math.isfinite(bias) for bias in biases):
        raise bad_request("logit_bias", f"'logit_bias' must map token ids to finite numbers, got {value!r}")
    try:
        tokens = [int(token) for token in value]
    except ValueError:
        raise bad_request("logit_bias", f"'logit_bias' keys must be token ids, got {list(value)!r}") from None
    check_token_ids("logit_bias", tokens, vocab_size, allow_empty=True)
    clamped = (max(-MAX_LOGIT_BIAS, min(MAX_LOGIT_BIAS, bias)) for bias in biases)
    return tuple(sorted(zip(tokens, clamped)))


def completion_logprobs(payload: dict) -> int | None:
    """Completions' `logprobs`: how many of the most likely tokens to report per position (-1: all)."""
    value = payload.get("logprobs")
    if value is None or value is False:
        return None
    if value is True:
        return 1  # as vLLM reads it
    return optional(payload, "logprobs", "int", None)


def chat_logprobs(payload: dict) -> int | None:
    """Chat's `logprobs` (whether) and `top_logprobs` (how many besides the sampled token)."""
    wanted = optional(payload, "logprobs", "bool", False)
    top = optional(payload, "top_logprobs", "int", 0)
    if top != 0 and not wanted:
        raise bad_request("top_logprobs", "when using 'top_logprobs', 'logprobs' must be set to true")
    return top if wanted else None


def parse_sampling(payload: dict, limits: CompletionLimits, *, max_new_tokens: int | None,
                   num_logprobs: int | None, echo: bool = False, logprobs_field: str = "logprobs",
                   adapter: str | None = None) -> SamplingParams:
    """The request's SamplingParams, generating at most `max_new_tokens`; a 400 naming the field at fault.
    With `max_new_tokens` None (a chat that sets no budget) the budget is provisional, the least the other
    fields allow, until the replica knows the prompt's length (`with_budget`)."""
    min_tokens = optional(payload, "min_tokens", "int", 0)
    fields = dict(
        temperature=_temperature(payload, limits), top_k=_top_k(payload),
        **{name: optional(payload, name, "number", neutral) for name, neutral in _NEUTRAL_NUMBERS.items()},
        logit_bias=_logit_bias(payload, limits.vocab_size), min_tokens=min_tokens,
        ignore_eos=optional(payload, "ignore_eos", "bool", False), stop=_stop(payload),
        stop_token_ids=_stop_token_ids(payload, limits.vocab_size),
        include_stop_str_in_output=optional(payload, "include_stop_str_in_output", "bool", False),
        n=optional(payload, "n", "int", 1), seed=seed_of(payload), num_logprobs=num_logprobs, echo=echo,
        prompt_logprobs=num_logprobs if echo else None,  # vLLM's: the echoed prompt's, as many per position
        adapter=adapter, structured_outputs=parse_structured_output(payload),
        skip_special_tokens=optional(payload, "skip_special_tokens", "bool", True),
    )
    budget = max_new_tokens if max_new_tokens is not None else max(1, min_tokens) if is_int(min_tokens) else 1
    with _as_bad_request({"num_logprobs": logprobs_field, "prompt_logprobs": logprobs_field}):
        sampling = SamplingParams(max_new_tokens=max(budget, 1), **fields)  # echo's max_tokens=0: one, unshown
    _check_logprobs_limit(sampling.num_logprobs, limits, logprobs_field)
    return sampling


def _check_logprobs_limit(num_logprobs: int | None, limits: CompletionLimits, field: str) -> None:
    """vLLM's bound on log-probabilities per position (-1 asks for the whole vocabulary, where its size is known)."""
    if num_logprobs is None or limits.max_logprobs == -1:
        return
    wanted = limits.vocab_size if num_logprobs == -1 else num_logprobs
    if wanted is not None and wanted > limits.max_logprobs:
        raise bad_request(field, f"Requested sample logprobs of {wanted}, which is greater than max allowed: "
                                 f"{limits.max_logprobs}")


def with_budget(sampling: SamplingParams, max_new_tokens: int, field: str = "max_tokens") -> SamplingParams:
    """`sampling` generating at most `max_new_tokens` (a 400 when its other fields do not allow that many)."""
    with _as_bad_request({"max_new_tokens": field}):
        return dataclasses.replace(sampling, max_new_tokens=max_new_tokens)


@contextlib.contextmanager
def _as_bad_request(request_fields: dict[str, str]):
    """A SamplingParamError as a 400 naming the request's field (`request_fields`: where its name differs)."""
    try:
        yield
    except SamplingParamError as error:
        field = request_fields.get(error.field, error.field)
        raise bad_request(field, f"'{field}'={error.value!r} is invalid: expected {error.allowed}") from None
