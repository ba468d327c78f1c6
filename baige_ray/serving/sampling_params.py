"""How one request samples, validated as vLLM validates its `SamplingParams`, and which engine honours what.

Every field has a neutral value (the default) at which it changes nothing. Both engines implement
every field here: the built-in engine in models/logits_processing.py (vLLM's order and semantics) and
serving/row_sampling.py, vLLM itself through serving/vllm_engine.py; `n` and `echo` are the routes'
(each of the n samples a request of its own, as vLLM fans them out). `unsupported_field` names what an
engine refuses at the value asked (vLLM's temperature bound), so a request asking for it is refused
rather than silently sampled another way. Plain Python: no Ray, no torch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from baige_ray.api.validation import is_int, is_number

ENGINES = ("builtin", "vllm")
MAX_LOGIT_BIAS = 100.0  # vLLM clamps a bias to [-100, 100]
MAX_VLLM_TEMPERATURE = 2.0  # vLLM's SamplingParams refuses more
GREEDY_BELOW = 1e-5  # vLLM's _SAMPLING_EPS: a temperature under it is greedy, and refuses n > 1


class SamplingParamError(ValueError):
    """A SamplingParams field out of its range; `field` names it, `value` and `allowed` say why."""

    def __init__(self, field: str, value: Any, allowed: str):
        super().__init__(f"SamplingParams.{field}={value!r} is invalid: expected {allowed}")
        self.field, self.value, self.allowed = field, value, allowed


def _require(ok: bool, field: str, value: Any, allowed: str) -> None:
    if not ok:
        raise SamplingParamError(field, value, allowed)


def _require_int(field: str, value: Any, minimum: int) -> None:
    _require(is_int(value) and value >= minimum, field, value, f"an integer >= {minimum}")


def _require_range(field: str, value: Any, low: float, high: float, allowed: str) -> None:
    # Written so that NaN fails: every comparison with NaN is false.
    _require(is_number(value) and low <= value <= high, field, value, allowed)


@dataclass(kw_only=True, frozen=True)
class SamplingParams:
    """How one request samples: temperature 0 is greedy; otherwise a draw from softmax(logits / temperature)
    over the whole vocabulary, narrowed only by what the request sets (`top_k`, `top_p`, `min_p`).

    `log_probs`: report each sampled token's log-probability under the model's own distribution
    (log-softmax of the raw logits: before temperature and top-k, as vLLM's raw log-probs), which is
    what a policy-gradient loss compares its policy with. `num_logprobs` is OpenAI's `logprobs` /
    `top_logprobs`: the most likely tokens' log-probabilities at each position, for the response;
    `prompt_logprobs` (vLLM's) the same for every prompt token (completions' `echo` with `logprobs`)."""

    max_new_tokens: int
    temperature: float = 1.0
    top_k: int | None = None  # None: the whole vocabulary
    top_p: float = 1.0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias added to its logit)
    min_tokens: int = 0
    ignore_eos: bool = False
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    include_stop_str_in_output: bool = False
    n: int = 1
    num_logprobs: int | None = None
    prompt_logprobs: int | None = None
    echo: bool = False
    seed: int | None = None
    log_probs: bool = False
    adapter: str | None = None  # the served LoRA adapter the request names as its model (None: the model alone)
    # Structured output (response_format, structured_outputs): vLLM's StructuredOutputsParams keyword arguments
    # as JSON text (structured_output.py); vLLM implements it, the built-in engine does not
    structured_outputs: str | None = None
    # vLLM's: the answer's text leaves the tokenizer's special tokens out (a tool-call parser may need them in)
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        self._check_budget()
        self._check_distribution()
        self._check_penalties()
        self._check_stops()
        self._check_output()

    def _check_budget(self) -> None:
        _require_int("max_new_tokens", self.max_new_tokens, 1)
        _require_int("min_tokens", self.min_tokens, 0)
        _require(self.min_tokens <= self.max_new_tokens, "min_tokens", self.min_tokens,
                 f"at most max_new_tokens={self.max_new_tokens}")
        if self.seed is not None:
            _require(is_int(self.seed) and 0 <= self.seed < 2**63, "seed", self.seed, "an integer in [0, 2**63)")

    def _check_distribution(self) -> None:
        _require(is_number(self.temperature) and math.isfinite(self.temperature) and self.temperature >= 0,
                 "temperature", self.temperature, "a finite number >= 0")
        if self.top_k is not None:
            _require_int("top_k", self.top_k, 1)
        _require(is_number(self.top_p) and 0 < self.top_p <= 1, "top_p", self.top_p, "a number in (0, 1]")
        _require_range("min_p", self.min_p, 0.0, 1.0, "a number in [0, 1]")

    def _check_penalties(self) -> None:
        _require_range("presence_penalty", self.presence_penalty, -2.0, 2.0, "a number in [-2, 2]")
        _require_range("frequency_penalty", self.frequency_penalty, -2.0, 2.0, "a number in [-2, 2]")
        _require(is_number(self.repetition_penalty) and 0 < self.repetition_penalty < math.inf,
                 "repetition_penalty", self.repetition_penalty, "a finite number > 0")
        for token, bias in self.logit_bias:
            _require(is_int(token) and token >= 0, "logit_bias", token, "token ids >= 0")
            _require_range("logit_bias", bias, -MAX_LOGIT_BIAS, MAX_LOGIT_BIAS, "biases in [-100, 100]")

    def _check_stops(self) -> None:
        _require(isinstance(self.stop, tuple) and all(isinstance(s, str) and s for s in self.stop),
                 "stop", self.stop, "a tuple of non-empty strings")
        _require(isinstance(self.stop_token_ids, tuple) and all(is_int(t) and t >= 0 for t in self.stop_token_ids),
                 "stop_token_ids", self.stop_token_ids, "a tuple of token ids >= 0")
        for name in ("ignore_eos", "include_stop_str_in_output", "echo", "log_probs"):
            _require(isinstance(getattr(self, name), bool), name, getattr(self, name), "a bool")
        _require(self.adapter is None or (isinstance(self.adapter, str) and self.adapter), "adapter", self.adapter,
                 "None or an adapter's name")

    def _check_output(self) -> None:
        _require(isinstance(self.skip_special_tokens, bool), "skip_special_tokens", self.skip_special_tokens,
                 "true or false")
        _require_int("n", self.n, 1)
        _require(self.n == 1 or self.temperature >= GREEDY_BELOW, "n", self.n,
                 "1 when using greedy sampling (temperature 0), as vLLM")
        for name in ("num_logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None:
                _require(is_int(value) and value >= -1, name, value, "an integer >= 0, or -1 for the whole vocabulary")


def stops_at(params: SamplingParams, token: int, eos_token_id: int | None) -> bool:
    """Whether sampling `token` ends the request (it is then not part of the answer's text)."""
    return (token == eos_token_id and not params.ignore_eos) or token in params.stop_token_ids


def unsupported_field(params: SamplingParams, engine: str) -> tuple[str, str] | None:
    """(request field, why) for the first field `engine` does not take at the value asked, or None. Both
    engines implement every sampling field; vLLM bounds the temperature, and structured output is vLLM's."""
    if engine not in ENGINES:
        raise ValueError(f"engine={engine!r} is invalid: expected one of {list(ENGINES)}")
    if engine == "builtin" and params.structured_outputs is not None:
        return "response_format", ("structured output ('response_format' json_object / json_schema, or "
                                   "'structured_outputs') is implemented by serve(engine='vllm'), not by the "
                                   "built-in engine")
    if engine == "vllm" and params.temperature > MAX_VLLM_TEMPERATURE:
        return "temperature", (f"temperature must be in [0, {MAX_VLLM_TEMPERATURE:g}] with vLLM, "
                               f"got {params.temperature}")
    return None


def require_implemented(params: SamplingParams, engine: str) -> None:
    """A ValueError naming the first field `engine` does not implement at the value asked (an engine's submit:
    never sample another way than asked)."""
    refused = unsupported_field(params, engine)
    if refused is not None:
        raise ValueError(refused[1])
