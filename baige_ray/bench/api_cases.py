"""`bench api`'s requests, what an answer is reduced to, and how two answers are compared.

Each case is one HTTP request the field's tools send to an OpenAI-compatible server: an evaluation
harness's log-likelihood request (`echo` with `logprobs`, `max_tokens` 1), `vllm bench serve`'s body
(`repetition_penalty` 1.0, `ignore_eos`, streamed with usage), token-id and batched prompts, chat with
typed content parts, every sampling field. Answers are reduced to what must agree between servers:
per choice its text, finish reason and log-probabilities; the usage; the HTTP status. The model name,
ids and timestamps are left out.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any

GREEDY = "greedy"  # the same tokens from every engine
SEEDED = "seeded"  # vLLM's random stream: equal between vLLM servers; the built-in engine equal to itself


@dataclass(frozen=True)
class ApiCase:
    name: str
    route: str  # "/v1/completions" or "/v1/chat/completions"
    body: dict[str, Any]  # without "model": each server gets its own model name
    kind: str = GREEDY
    # Asks for a tool call: the vLLM servers parse them (--tool-call-parser hermes, serve's tool_call_parser),
    # the built-in engine must refuse it with a 400
    tool_call: bool = False

    @property
    def streamed(self) -> bool:
        return bool(self.body.get("stream"))


@dataclass
class Choice:
    index: int
    text: str = ""
    finish_reason: str | None = None
    tokens: list[str] = field(default_factory=list)  # the tokens the log-probabilities are of
    logprobs: list[float | None] = field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = field(default_factory=list)
    tool_calls: dict[int, list[str]] = field(default_factory=dict)  # index -> [name, arguments] (ids left out)


@dataclass
class Answer:
    status: int
    choices: dict[int, Choice] = field(default_factory=dict)
    usage: dict[str, int] | None = None
    error: str | None = None  # the error body's message when status is not 200


COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"


def api_cases(token_ids: list[int], max_tokens: int = 16) -> list[ApiCase]:
    """The requests, each field of the serving table at least once. `token_ids`: a prompt's tokens (a few
    of the tokenizer's ids), for the token-id prompts and the logit bias."""
    greedy = {"temperature": 0.0, "max_tokens": max_tokens}
    parts = [{"type": "text", "text": "Write a loop"}, {"type": "text", "text": " over a list."}]
    chat = [{"role": "system", "content": "You write Python."}, {"role": "user", "content": parts}]
    forced = token_ids[1]
    weather = {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
    named = {"type": "function", "function": {"name": "get_weather"}}
    tool_chat = [{"role": "user", "content": "Weather in Paris?"}]
    return [
        ApiCase("completion", COMPLETIONS, {"prompt": "def ", **greedy}),
        ApiCase("completion default length", COMPLETIONS, {"prompt": "import ", "temperature": 0.0}),
        ApiCase("batched prompts", COMPLETIONS, {"prompt": ["def ", "class ", "return "], **greedy}),
        ApiCase("token-id prompt", COMPLETIONS, {"prompt": token_ids, **greedy}),
        ApiCase("token-id prompts", COMPLETIONS, {"prompt": [token_ids, token_ids[:2]], **greedy}),
        ApiCase("logprobs", COMPLETIONS, {"prompt": "for ", "logprobs": 3, **greedy}),
        # An evaluation harness's log-likelihood request: the prompt's own log-probabilities come back.
        ApiCase("echo with logprobs", COMPLETIONS,
                {"prompt": "def parse(path):\n    return", "echo": True, "logprobs": 1, "temperature": 0.0,
                 "max_tokens": 1}),
        ApiCase("echo", COMPLETIONS, {"prompt": "while ", "echo": True, **greedy}),
        ApiCase("stop strings", COMPLETIONS, {"prompt": "def ", "stop": ["\n", "(", ":", " "], **greedy}),
        ApiCase("stop string kept", COMPLETIONS,
                {"prompt": "def ", "stop": ["(", " "], "include_stop_str_in_output": True, **greedy}),
        ApiCase("stop token ids", COMPLETIONS, {"prompt": "if ", "stop_token_ids": token_ids[:3], **greedy}),
        ApiCase("min tokens and ignore eos", COMPLETIONS,
                {"prompt": "with ", "min_tokens": 4, "ignore_eos": True, **greedy}),
        ApiCase("penalties", COMPLETIONS,
                {"prompt": "x = x + x + x", "presence_penalty": 0.5, "frequency_penalty": 0.5,
                 "repetition_penalty": 1.3, **greedy}),
        ApiCase("logit bias", COMPLETIONS, {"prompt": "def ", "logit_bias": {str(forced): 100}, **greedy}),
        ApiCase("truncated prompt", COMPLETIONS,
                {"prompt": "import os\nimport sys\nimport json\n", "truncate_prompt_tokens": 4, **greedy}),
        ApiCase("special tokens kept", COMPLETIONS, {"prompt": "def ", "skip_special_tokens": False, **greedy}),
        ApiCase("unknown fields", COMPLETIONS,
                {"prompt": "def ", "best_of": None, "harness_tag": "mmlu", "user": "eval", **greedy}),
        # `vllm bench serve`'s own body for the openai backend.
        ApiCase("vllm bench serve body", COMPLETIONS,
                {"prompt": "class ", "temperature": 0.0, "repetition_penalty": 1.0, "max_tokens": max_tokens,
                 "logprobs": None, "stream": True, "stream_options": {"include_usage": True},
                 "ignore_eos": True}),
        ApiCase("stream with continuous usage", COMPLETIONS,
                {"prompt": "try:", "stream": True,
                 "stream_options": {"include_usage": True, "continuous_usage_stats": True}, **greedy}),
        ApiCase("seeded sampling", COMPLETIONS,
                {"prompt": "def ", "temperature": 1.0, "top_p": 0.9, "top_k": 20, "min_p": 0.02, "seed": 7,
                 "n": 2, "max_tokens": max_tokens}, SEEDED),
        ApiCase("chat", CHAT, {"messages": chat, "temperature": 0.0, "max_completion_tokens": max_tokens}),
        ApiCase("chat logprobs", CHAT,
                {"messages": chat, "temperature": 0.0, "max_tokens": max_tokens, "logprobs": True,
                 "top_logprobs": 2}),
        ApiCase("chat streamed", CHAT,
                {"messages": chat, "temperature": 0.0, "max_tokens": max_tokens, "stream": True,
                 "stream_options": {"include_usage": True}}),
        ApiCase("chat without a length", CHAT,
                {"messages": [{"role": "user", "content": "Hi"}], "temperature": 0.0, "ignore_eos": True}),
        ApiCase("chat sampling fields", CHAT,
                {"messages": chat, "presence_penalty": 0.5, "frequency_penalty": 0.5, "repetition_penalty": 1.2,
                 "min_tokens": 2, "stop": ["\n"], "include_stop_str_in_output": True, "stop_token_ids": token_ids[:2],
                 "truncate_prompt_tokens": 12, "user": "eval", "skip_special_tokens": False, **greedy}),
        ApiCase("chat seeded", CHAT,
                {"messages": chat, "temperature": 0.8, "top_p": 0.95, "top_k": 50, "min_p": 0.01,
                 "logit_bias": {str(forced): 2}, "seed": 3, "n": 2, "max_tokens": max_tokens}, SEEDED),
        ApiCase("chat with tools", CHAT,
                {"messages": chat, "tools": [{"type": "function", "function": {
                    "name": "add", "description": "Sum two numbers.",
                    "parameters": {"type": "object", "properties": {"a": {"type": "number"}}}}}],
                 "tool_choice": "none", **greedy}),
        ApiCase("chat with tools and no tool_choice", CHAT,
                {"messages": chat, "tools": [{"type": "function", "function": {"name": "add"}}], **greedy},
                tool_call=True),
        ApiCase("tool choice auto", CHAT,
                {"messages": tool_chat, "tools": [weather], "tool_choice": "auto", "parallel_tool_calls": False,
                 **greedy}, tool_call=True),
        ApiCase("tool choice required", CHAT,
                {"messages": tool_chat, "tools": [weather], "tool_choice": "required", **greedy}, tool_call=True),
        ApiCase("tool choice named", CHAT,
                {"messages": tool_chat, "tools": [weather], "tool_choice": named, **greedy}, tool_call=True),
        ApiCase("tool choice named streamed", CHAT,
                {"messages": tool_chat, "tools": [weather], "tool_choice": named, "stream": True, **greedy},
                tool_call=True),
        ApiCase("prompt longer than the context", COMPLETIONS, {"prompt": "x " * 2000, **greedy}),
        ApiCase("negative max_tokens", COMPLETIONS, {"prompt": "def ", "max_tokens": -1}),
    ]


def read_answer(status: int, payload: Any) -> Answer:
    """An answer from a non-streamed response's status and JSON body."""
    if status != 200:
        return Answer(status, error=_error_message(payload))
    answer = Answer(status, usage=_usage(payload.get("usage")))
    for raw in payload.get("choices", []):
        choice = Choice(raw["index"], finish_reason=raw.get("finish_reason"))
        if "message" in raw:  # chat
            choice.text = raw["message"].get("content") or ""
            for number, call in enumerate(raw["message"].get("tool_calls") or []):
                choice.tool_calls[number] = [call["function"]["name"], call["function"]["arguments"]]
            _chat_logprobs(choice, raw.get("logprobs"))
        else:
            choice.text = raw.get("text", "")
            _completion_logprobs(choice, raw.get("logprobs"))
        answer.choices[choice.index] = choice
    return answer


def read_stream(status: int, events: list[Any]) -> Answer:
    """An answer from a streamed response: the chunks' pieces joined per choice, the last usage kept."""
    if status != 200:
        return Answer(status, error=_error_message(events[0] if events else None))
    answer = Answer(status)
    for chunk in events:
        if chunk.get("usage"):
            answer.usage = _usage(chunk["usage"])
        for raw in chunk.get("choices", []):
            choice = answer.choices.setdefault(raw["index"], Choice(raw["index"]))
            choice.text += (raw.get("delta") or {}).get("content") or raw.get("text") or ""
            for call in (raw.get("delta") or {}).get("tool_calls") or []:  # a call's name, then its arguments
                pieces = choice.tool_calls.setdefault(call.get("index", 0), ["", ""])
                pieces[0] += (call.get("function") or {}).get("name") or ""
                pieces[1] += (call.get("function") or {}).get("arguments") or ""
            if raw.get("finish_reason") is not None:
                choice.finish_reason = raw["finish_reason"]
            if "delta" in raw:
                _chat_logprobs(choice, raw.get("logprobs"))
            else:
                _completion_logprobs(choice, raw.get("logprobs"))
    return answer


def compare(reference: Answer, candidate: Answer, *, logprob_tolerance: float) -> list[str]:
    """How `candidate` differs from `reference`: statuses; per choice the text, finish reason,
    log-probabilities' tokens and values (within `logprob_tolerance`); usage. Empty when they agree."""
    if reference.status != candidate.status:
        return [f"status {candidate.status} where the reference answered {reference.status}"
                f" ({candidate.error or reference.error})"]
    if reference.status != 200:
        return []
    problems = []
    if sorted(reference.choices) != sorted(candidate.choices):
        return [f"choices {sorted(candidate.choices)} where the reference has {sorted(reference.choices)}"]
    for index, expected in sorted(reference.choices.items()):
        got = candidate.choices[index]
        if got.text != expected.text:
            problems.append(f"choice {index}: text {got.text!r} where the reference has {expected.text!r}")
        if got.finish_reason != expected.finish_reason:
            problems.append(f"choice {index}: finish_reason {got.finish_reason!r}, reference {expected.finish_reason!r}")
        if got.tool_calls != expected.tool_calls:
            problems.append(f"choice {index}: tool calls {got.tool_calls} where the reference has {expected.tool_calls}")
        problems += _compare_logprobs(index, expected, got, logprob_tolerance)
    if reference.usage != candidate.usage:
        problems.append(f"usage {candidate.usage} where the reference has {reference.usage}")
    return problems


def _compare_logprobs(index: int, expected: Choice, got: Choice, tolerance: float) -> list[str]:
    if got.tokens != expected.tokens:
        return [f"choice {index}: log-probability tokens {got.tokens[:8]} where the reference has {expected.tokens[:8]}"]
    if len(got.logprobs) != len(expected.logprobs):
        return [f"choice {index}: {len(got.logprobs)} log-probabilities where the reference has {len(expected.logprobs)}"]
    worst = _worst_difference(expected.logprobs, got.logprobs)
    for want, have in zip(expected.top_logprobs, got.top_logprobs):
        if (want is None) != (have is None):
            return [f"choice {index}: top log-probabilities present in one answer only"]
        if want is not None:
            if set(want) != set(have):
                return [f"choice {index}: top tokens {sorted(have)} where the reference has {sorted(want)}"]
            worst = max(worst, _worst_difference([want[k] for k in want], [have[k] for k in want]))
    if worst > tolerance:
        return [f"choice {index}: log-probabilities differ by {worst:.2e} (tolerance {tolerance:.0e})"]
    return []


def _worst_difference(expected: list[float | None], got: list[float | None]) -> float:
    worst = 0.0
    for want, have in zip(expected, got):
        if (want is None) != (have is None):
            return math.inf
        if want is not None:
            both_infinite = math.isinf(want) and math.isinf(have) and (want > 0) == (have > 0)
            worst = max(worst, 0.0 if both_infinite else abs(want - have))
    return worst


def _completion_logprobs(choice: Choice, logprobs: dict | None) -> None:
    """OpenAI's completions shape: parallel lists of tokens, their log-probabilities and top-k dicts."""
    if not logprobs:
        return
    choice.tokens += logprobs.get("tokens") or []
    choice.logprobs += logprobs.get("token_logprobs") or []
    choice.top_logprobs += logprobs.get("top_logprobs") or []


def _chat_logprobs(choice: Choice, logprobs: dict | None) -> None:
    """OpenAI's chat shape: a content list of {token, logprob, top_logprobs: [{token, logprob}]}."""
    for entry in (logprobs or {}).get("content") or []:
        choice.tokens.append(entry["token"])
        choice.logprobs.append(entry["logprob"])
        choice.top_logprobs.append({top["token"]: top["logprob"] for top in entry.get("top_logprobs") or []})


def _usage(usage: dict | None) -> dict[str, int] | None:
    if not usage:
        return None
    return {key: usage[key] for key in ("prompt_tokens", "completion_tokens", "total_tokens") if key in usage}


def _error_message(payload: Any) -> str:
    if isinstance(payload, dict):
        error = payload.get("error", payload)
        return str(error.get("message", error) if isinstance(error, dict) else error)[:200]
    return json.dumps(payload)[:200] if payload is not None else ""
