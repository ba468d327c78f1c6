"""Prefill/decode hand-offs with and without prefix caches: the keys and values a hand-off carries.

The sessions run one turn at a time through a `PrefillEngine` and a `ContinuousBatchingEngine` (the
disaggregated pair, in this process), each turn's prompt the one before, its answer and a new message.
Without caches every hand-off carries its whole prompt's keys and values; with a prefix cache on each side
the decode engine says how many leading tokens it holds and the hand-off carries only the rest.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any


def _kv_bytes(kv) -> int:
    return sum(keys.numel() * keys.element_size() + values.numel() * values.element_size() for keys, values in kv)


def _run(decoder, sessions: Sequence, answer_tokens: int, store: Callable | None) -> dict[str, Any]:
    from baige_ray.serving.causal_lm_generation import SamplingParams
    from baige_ray.serving.engine import ContinuousBatchingEngine
    from baige_ray.serving.prefill import PrefillEngine, generate_disaggregated

    prefill = PrefillEngine(decoder, eos_token_id=None, prefixes=store() if store else None)
    decode = ContinuousBatchingEngine(decoder, eos_token_id=None, prefixes=store() if store else None)
    params = [SamplingParams(max_new_tokens=answer_tokens, temperature=0.0)]
    hand_offs, answers = [], []
    for session in sessions:
        prompt = list(session.system)
        for message in session.messages:
            prompt += list(message)
            (generation,) = generate_disaggregated(prefill, decode, [prompt], params, hand_offs=hand_offs)
            answers.append(generation.tokens)
            prompt += generation.tokens
    return {"hand_offs": len(hand_offs), "bytes": sum(_kv_bytes(h.kv) for h in hand_offs),
            "prompt_tokens": sum(h.prompt_length for h in hand_offs),
            "tokens_sent": sum(h.prompt_length - h.kv_from for h in hand_offs), "answers": answers}


def measure_handoffs(decoder, sessions: Sequence, *, answer_tokens: int, store: Callable) -> dict[str, Any]:
    """Hand-off bytes without caches and with a prefix cache on both sides, over bench/prefix.py's sessions
    (a `system` prompt and user `messages`, token ids); `store()` makes one cache."""
    without = _run(decoder, sessions, answer_tokens, None)
    cached = _run(decoder, sessions, answer_tokens, store)
    return {"without_cache": {k: v for k, v in without.items() if k != "answers"},
            "with_cache": {k: v for k, v in cached.items() if k != "answers"},
            "bytes_ratio": cached["bytes"] / without["bytes"] if without["bytes"] else None,
            "tokens_equal": without["answers"] == cached["answers"]}
