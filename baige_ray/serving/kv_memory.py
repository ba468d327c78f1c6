"""How much of a replica's memory the built-in engine's keys and values may take, and what fits in it.

vLLM sizes its KV cache in bytes (`kv_cache_memory_bytes`, or a fraction of the device) and will not start
with a context it cannot hold. The built-in engine takes the same budget (`EngineLimits.kv_cache_memory_bytes`)
and serves within it: a request that could not fit even alone is refused with the numbers, the context it
reports (`max_model_len`) is what its memory holds, a request waits for admission until the running batch
leaves it room, and when the rows' growth would pass the budget the newest row leaves the batch and is
recomputed once there is room again (vLLM's recompute preemption). Without a budget a long enough prompt
grows the cache until the process runs out.

What a step holds is counted from how this engine computes (serving/kv_batch.py): its pool keeps every
running row's blocks, and each forward gathers a dense view of the batch (rows x longest row) that the
model returns again with one more column, so a step holds the pool and two views. Activations (the
attention of a long prefill, the logits) are not counted: keep room for them beside the budget.
Plain arithmetic on token counts; the footprint is read off a cache the model returned.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

from baige_ray.api.validation import require_int
from baige_ray.models.generation import KV

VIEWS_PER_STEP = 2  # the batch's dense view, and the cache the forward returns with one more column
MIB = 1 << 20


@dataclass(frozen=True)
class KVFootprint:
    """The keys and values one token leaves in every layer."""

    layers: int
    kv_heads: int
    head_dim: int
    element_bytes: int
    bytes_per_token: int

    @classmethod
    def of(cls, cache: KV) -> KVFootprint:
        """Read off a cache the model returned (any batch and length): what each token of it holds."""
        keys = cache[0][0]
        per_token = sum(k.shape[1] * k.shape[3] * k.element_size() + v.shape[1] * v.shape[3] * v.element_size()
                        for k, v in cache)
        return cls(layers=len(cache), kv_heads=keys.shape[1], head_dim=keys.shape[3],
                   element_bytes=keys.element_size(), bytes_per_token=per_token)

    def describe(self) -> str:
        return (f"{self.bytes_per_token:,} bytes a token: {self.layers} layers x keys and values x "
                f"{self.kv_heads} KV heads x {self.head_dim} dims x {self.element_bytes} bytes")


@dataclass(frozen=True)
class KVMemoryBudget:
    """`budget_bytes` for the keys and values of a batch, paged in blocks of `block_tokens`."""

    budget_bytes: int
    footprint: KVFootprint
    block_tokens: int

    def __post_init__(self) -> None:
        require_int("KVMemoryBudget", "budget_bytes", self.budget_bytes, minimum=1)
        require_int("KVMemoryBudget", "block_tokens", self.block_tokens, minimum=1)

    def pool_blocks(self, lengths: Sequence[int]) -> int:
        """Blocks a pool holding rows of `lengths` tokens needs, its padding block included."""
        return 1 + sum(-(-length // self.block_tokens) for length in lengths)

    def step_bytes(self, lengths: Sequence[int], pool_blocks: int = 0) -> int:
        """Bytes a step holds with rows that may grow to `lengths` tokens, in a pool of at least `pool_blocks`."""
        if not lengths:
            return pool_blocks * self.block_tokens * self.footprint.bytes_per_token
        pool = max(pool_blocks, self.pool_blocks(lengths)) * self.block_tokens
        views = VIEWS_PER_STEP * len(lengths) * max(lengths)
        return (pool + views) * self.footprint.bytes_per_token

    def holds(self, lengths: Sequence[int], pool_blocks: int = 0) -> bool:
        return self.step_bytes(lengths, pool_blocks) <= self.budget_bytes

    def rows_to_preempt(self, lengths: Sequence[int], others: Sequence[int], pool_blocks: int,
                        recomputable: Sequence[bool]) -> list[int]:
        """Rows of a batch (rows of `lengths` tokens after the next step, in admission order, beside `others`
        still prefilling) to take out, newest first, until the rest fits a pool of `pool_blocks` or more. The
        oldest row stays: the budget holds any one request alone, though a pool grown for earlier rows (it
        cannot shrink while a row runs, and is given back when the batch empties) may still pass it."""
        kept = list(range(len(lengths)))
        taken: list[int] = []
        while not self.holds([lengths[row] for row in kept] + list(others), pool_blocks):
            candidates = [row for row in kept[1:] if recomputable[row]]
            if not candidates:
                break
            taken.append(candidates[-1])
            kept.remove(candidates[-1])
        return taken

    @cached_property  # read on every request (the replica's context)
    def max_tokens_alone(self) -> int:
        """The longest request (prompt plus new tokens) the budget holds with nothing else running."""
        low, high = 0, self.budget_bytes // self.footprint.bytes_per_token
        while low < high:  # step_bytes grows with the length
            middle = (low + high + 1) // 2
            low, high = (middle, high) if self.holds([middle]) else (low, middle - 1)
        return low

    def describe(self) -> str:
        """Why a replica's context is what it is, for an error a client reads."""
        return (f"This replica's KV cache holds at most {self.max_tokens_alone:,} tokens for one request "
                f"(kv_cache_memory_bytes={self.budget_bytes:,}, {self.budget_bytes / MIB:.1f} MiB, at "
                f"{self.footprint.describe()}; a step holds its pool and {VIEWS_PER_STEP} dense views of the batch)")

    def refusal(self, prompt_tokens: int, new_tokens: int) -> str | None:
        """Why a request of `prompt_tokens` and up to `new_tokens` more can never run here, or None."""
        total = prompt_tokens + new_tokens
        if total <= self.max_tokens_alone:
            return None
        return (f"{self.describe()}. However, you requested {total:,} tokens: {prompt_tokens:,} in the prompt and "
                f"{new_tokens:,} to generate, which need {self.step_bytes([total]) / MIB:.1f} MiB. Shorten the "
                "prompt, ask for fewer tokens, or serve with a larger kv_cache_memory_bytes")
