"""Log-probabilities in OpenAI's response shapes, cut as vLLM's server cuts them from its per-position
dicts (serving/token_logprobs.py: the token there first, then the likeliest). Plain Python: no Ray, no torch.

Completions (`logprobs=k`): `{"text_offset", "token_logprobs", "tokens", "top_logprobs"}`; a position's
top_logprobs is a {token text: log-probability} dict of its first k + 1 pairs (the token there and the k
likeliest), None where a position has none (the first prompt token's when echoed); the text offsets add
up each token's text from `initial_offset` (a stream's next chunk goes on where the last one ended).
Chat (`logprobs: true`, `top_logprobs: k`): `{"content": [...]}`, an entry per token with its text,
log-probability, UTF-8 bytes and its first k pairs. A token's text is the codec's `token_text`, and a
log-probability is clamped at -9999.0, which stands in for minus infinity, as in vLLM.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from baige_ray.serving.logprob_token_names import LogprobTokenNames
from baige_ray.serving.token_logprobs import TokenLogprobs

FLOOR = -9999.0


def _clamped(log_prob: float) -> float:
    return max(log_prob, FLOOR)


def completion_logprobs(tokens: Sequence[int], entries: Sequence[TokenLogprobs | None], num_logprobs: int,
                        names: LogprobTokenNames, initial_offset: int = 0, *, num_prompt: int = 0,
                        generated_before: Sequence[int] = ()) -> dict:
    """The `logprobs` of a completions choice (or chunk) whose tokens are `tokens`, entries[i] token i's: the
    first `num_prompt` are an echoed prompt's, the rest generated after the tokens `generated_before`."""
    texts, token_logprobs, top, offsets = [], [], [], []
    offset = initial_offset
    generated, prompt_read = list(generated_before), []
    for position, (token, entry) in enumerate(zip(tokens, entries, strict=True)):
        if position >= num_prompt:
            name = names.after(generated)
            generated.append(token)
        elif entry is None:  # the first prompt token: no entry, and not among the tokens later ones read after
            name = names.plain
        else:
            name = names.after(prompt_read)
            prompt_read.append(token)
        text = name(token)
        texts.append(text)
        offsets.append(offset)
        offset += len(text)
        kept = entry if entry is None or num_logprobs == -1 else entry[:num_logprobs + 1]
        token_logprobs.append(None if entry is None else _clamped(entry[0][1]))
        top.append(None if kept is None else {name(t): _clamped(value) for t, value in kept})
    return {"text_offset": offsets, "token_logprobs": token_logprobs, "tokens": texts, "top_logprobs": top}


def next_text_offset(logprobs: dict, previous: int) -> int:
    """Where the next chunk's text offsets begin: after the last token these logprobs reported."""
    if not logprobs["tokens"]:
        return previous
    return logprobs["text_offset"][-1] + len(logprobs["tokens"][-1])


def _chat_token(token: int, log_prob: float, name: Callable[[int], str]) -> dict:
    text = name(token)
    return {"token": text, "logprob": _clamped(log_prob), "bytes": list(text.encode("utf-8", errors="replace"))}


def chat_logprobs(entries: Sequence[TokenLogprobs], num_logprobs: int, names: LogprobTokenNames,
                  generated_before: Sequence[int] = ()) -> dict:
    """The `logprobs` of a chat choice (or chunk) whose tokens' entries are `entries`, generated after the
    tokens `generated_before`."""
    content = []
    generated = list(generated_before)
    for entry in entries:
        kept = entry if num_logprobs == -1 else entry[:num_logprobs]
        token, log_prob = entry[0]
        name = names.after(generated)
        generated.append(token)
        content.append({**_chat_token(token, log_prob, name),
                        "top_logprobs": [_chat_token(t, value, name) for t, value in kept]})
    return {"content": content}
