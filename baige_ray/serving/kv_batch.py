"""The KV cache of a running batch whose rows join and leave at any step, paged in fixed-size blocks.

Keys and values live in one pool per layer of token slots `[slots, kv_heads, head_dim]`, handed out in
blocks of `block_tokens` consecutive slots; a row holds a block table (its blocks in order) and its
length, and asks for a new block only when its last one is full. A joining row's prefilled cache is
copied into blocks of its own, a leaving row's blocks go back to the free list, and a decode step
writes one slot per row: joins, leaves and steps never copy the other rows' keys and values, and no
row holds more than one partly filled block. Blocks freed are reused before the pool grows (it doubles).

Attention runs in plain torch on a dense view gathered from the pool (`layers`): per layer
`[rows, kv_heads, columns, head_dim]`, left-padded, a row holding `length` tokens in the last `length`
columns and the attention mask hiding the rest, so every row's newest token is in the last column and
one decode forward over all rows appends one column (`grow` writes that column into the pool). The
view lives for one forward: the pool is the only copy kept between steps. Gathering for every forward
cost nothing measurable at 4 rows of about 600 tokens (47.9 tokens/s against 47.7 with the view kept
between steps) and about 8% at one row, where a decode step is cheapest (84-85 against 92-93 tokens/s
for the dense batch this replaced; the gather was 3% of a profiled run). It holds exactly the numbers a
dense left-padded batch would, so tokens do not change.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from baige_ray.api.validation import require_int
from baige_ray.models.generation import KV

DEFAULT_BLOCK_TOKENS = 16
INITIAL_BLOCKS = 8


class PagedKVBatch:
    def __init__(self, block_tokens: int = DEFAULT_BLOCK_TOKENS):
        require_int("PagedKVBatch", "block_tokens", block_tokens, minimum=1)
        self.block_tokens = block_tokens
        self._keys: list[torch.Tensor] = []  # per layer [slots, kv_heads, head_dim]; block 0 stays zero (padding)
        self._values: list[torch.Tensor] = []
        self._free: list[int] = []
        self.tables: list[list[int]] = []
        self.lengths: list[int] = []
        # Each row's slot of every token it holds, in order: the gather index is built from these lists in
        # one call, not from tensors per row (on a small model that bookkeeping was a fifth of a decode step).
        self._row_slots: list[list[int]] = []
        # At most this many blocks (None: no bound): a KV memory budget (kv_memory.py) sets it from what the
        # running rows may grow to, so that doubling the pool does not take more than the budget counted.
        self.max_blocks: int | None = None

    @property
    def num_rows(self) -> int:
        return len(self.lengths)

    @property
    def num_columns(self) -> int:
        return max(self.lengths, default=0)

    @property
    def num_blocks(self) -> int:
        """Blocks the pool has room for (the padding block included)."""
        return self._keys[0].shape[0] // self.block_tokens if self._keys else 0

    @property
    def pool_bytes(self) -> int:
        """Bytes the pool holds, free blocks included."""
        return sum(t.numel() * t.element_size() for t in (*self._keys, *self._values))

    @property
    def blocks_in_use(self) -> int:
        return sum(len(table) for table in self.tables)

    def add(self, row: KV, length: int, copies: int = 1) -> None:
        """Append `copies` rows that start alike (the samplings of one prompt): a batch-1 cache of `length`
        columns, all of them real tokens, copied into blocks of each row's own."""
        if row[0][0].shape[0] != 1 or row[0][0].shape[2] != length:
            raise ValueError(f"a joining row must be one sequence of {length} columns, got {tuple(row[0][0].shape)}")
        require_int("PagedKVBatch.add", "copies", copies, minimum=1)
        if not self._keys:
            self._build_pool(row)
        added = []
        for _ in range(copies):
            table = [self._take_block() for _ in range(-(-length // self.block_tokens))]
            self.tables.append(table)
            self.lengths.append(length)
            self._row_slots.append(self._slots(table, length))
            added.extend(self._row_slots[-1])
        slots = torch.tensor(added, dtype=torch.long, device=self._keys[0].device)
        for layer, (keys, values) in enumerate(row):
            self._keys[layer][slots] = keys[0].transpose(0, 1).repeat(copies, 1, 1)
            self._values[layer][slots] = values[0].transpose(0, 1).repeat(copies, 1, 1)

    def keep(self, rows: Sequence[int]) -> None:
        """Keep only `rows` (in that order); the others' blocks are free again."""
        kept = set(rows)
        for index, table in enumerate(self.tables):
            if index not in kept:
                self._free.extend(table)
        self.tables = [self.tables[row] for row in rows]
        self.lengths = [self.lengths[row] for row in rows]
        self._row_slots = [self._row_slots[row] for row in rows]

    @property
    def layers(self) -> KV:
        """Per layer (keys, values) `[rows, kv_heads, columns, head_dim]`, left-padded with zeros."""
        if not self.lengths:
            return []
        index = self._gather_index().to(self._keys[0].device)
        return [(keys[index].permute(0, 2, 1, 3), values[index].permute(0, 2, 1, 3))
                for keys, values in zip(self._keys, self._values)]

    def row(self, row: int) -> KV:
        """One row's keys and values, batch 1 `[1, kv_heads, length, head_dim]` per layer (no padding)."""
        slots = torch.tensor(self._row_slots[row], dtype=torch.long, device=self._keys[0].device)
        return [(keys[slots].permute(1, 0, 2)[None], values[slots].permute(1, 0, 2)[None])
                for keys, values in zip(self._keys, self._values)]

    def grow(self, layers: KV) -> None:
        """Take the newest column of the cache a decode forward returned (one new token per row)."""
        if layers[0][0].shape[2] != self.num_columns + 1:
            raise ValueError(f"expected {self.num_columns + 1} columns after a decode step, got {layers[0][0].shape[2]}")
        new_slots = []
        for row, length in enumerate(self.lengths):
            if length % self.block_tokens == 0:
                self.tables[row].append(self._take_block())
            slot = self.tables[row][-1] * self.block_tokens + length % self.block_tokens
            self._row_slots[row].append(slot)
            new_slots.append(slot)
        slots = torch.tensor(new_slots, dtype=torch.long, device=self._keys[0].device)
        for layer, (keys, values) in enumerate(layers):
            self._keys[layer][slots] = keys[:, :, -1, :]
            self._values[layer][slots] = values[:, :, -1, :]
        self.lengths = [length + 1 for length in self.lengths]

    def attention_mask(self, new_columns: int = 1) -> torch.Tensor:
        """`[rows, columns + new_columns]`: 1 where a row holds a token (the new columns included)."""
        columns = torch.arange(self.num_columns + new_columns)
        first = torch.tensor([self.num_columns - length for length in self.lengths])
        return (columns[None, :] >= first[:, None]).long()

    def next_positions(self) -> torch.Tensor:
        """`[rows, 1]`: the position of each row's next token (its count of tokens so far)."""
        return torch.tensor(self.lengths, dtype=torch.long)[:, None]

    # ---- the pool -------------------------------------------------------------------------------

    def _build_pool(self, row: KV) -> None:
        keys = row[0][0]
        blocks = INITIAL_BLOCKS if self.max_blocks is None else max(2, min(INITIAL_BLOCKS, self.max_blocks))
        shape = (blocks * self.block_tokens, keys.shape[1], keys.shape[3])
        self._keys = [torch.zeros(shape, dtype=k.dtype, device=k.device) for k, _ in row]
        self._values = [torch.zeros(shape, dtype=v.dtype, device=v.device) for _, v in row]
        self._free = list(range(blocks - 1, 0, -1))  # block 0 is the padding block

    def _take_block(self) -> int:
        if not self._free:
            self._double_pool()
        return self._free.pop()

    def _double_pool(self) -> None:
        old = self.num_blocks
        new = 2 * old if self.max_blocks is None else min(2 * old, self.max_blocks)
        if new <= old:
            raise RuntimeError(f"the KV pool is full at {old} blocks (max_blocks={self.max_blocks}): the engine "
                               "admitted more than its memory budget holds")
        extra = (new - old) * self.block_tokens
        self._keys = [torch.cat([keys, keys.new_zeros((extra, *keys.shape[1:]))]) for keys in self._keys]
        self._values = [torch.cat([values, values.new_zeros((extra, *values.shape[1:]))]) for values in self._values]
        self._free.extend(range(new - 1, old - 1, -1))

    def _slots(self, table: list[int], length: int) -> list[int]:
        """The slots of a row's first `length` tokens, its blocks in `table`."""
        return [table[position // self.block_tokens] * self.block_tokens + position % self.block_tokens
                for position in range(length)]

    def _gather_index(self) -> torch.Tensor:
        """`[rows, columns]` slot of every column; the padding columns point at slot 0, in the zero block."""
        width = self.num_columns
        return torch.tensor([[0] * (width - len(slots)) + slots for slots in self._row_slots], dtype=torch.long)
