"""The user's reward on each completion's text, checked: what every placement scores rollouts with."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

Reward = Callable[[str, str], float]


def score(reward: Reward, prompts: Sequence[str], completions: Sequence[Sequence[int]], tokenizer: Any) -> list[float]:
    """reward(prompts[i], text of completions[i]) for each i, special tokens left out of the text; a
    ValueError names the first value that is not a finite number."""
    rewards = []
    for prompt, completion in zip(prompts, completions, strict=True):
        text = tokenizer.decode(list(completion), skip_special_tokens=True)
        value = reward(prompt, text)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ValueError(f"reward({prompt!r}, {text!r}) returned {value!r}: expected a finite number")
        rewards.append(float(value))
    return rewards
