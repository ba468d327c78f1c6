"""The KV cache of a running batch whose rows join and leave at any step.

Per layer one key and one value tensor `[rows, kv_heads, columns, head_dim]`, left-padded: a row
holding `length` tokens occupies the last `length` columns and the attention mask hides the rest.
Every row's newest token is in the last column, so one decode forward over all rows appends one
column. A joining row brings its own prefilled cache (batch 1); whichever side is shorter is padded
on the left. A leaving row is dropped, and columns that only padding fills any more are cut.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from baige_ray.models.generation import KV


def _left_pad(tensor: torch.Tensor, columns: int) -> torch.Tensor:
    missing = columns - tensor.shape[2]
    return F.pad(tensor, (0, 0, missing, 0)) if missing else tensor


class PaddedKVBatch:
    def __init__(self) -> None:
        self.layers: KV = []
        self.lengths: list[int] = []

    @property
    def num_rows(self) -> int:
        return len(self.lengths)

    @property
    def num_columns(self) -> int:
        return self.layers[0][0].shape[2] if self.layers else 0

    def add(self, row: KV, length: int) -> None:
        """Append a row: a batch-1 cache of `length` columns, all of them real tokens."""
        if row[0][0].shape[0] != 1 or row[0][0].shape[2] != length:
            raise ValueError(f"a joining row must be one sequence of {length} columns, got {tuple(row[0][0].shape)}")
        if not self.lengths:
            self.layers, self.lengths = list(row), [length]
            return
        width = max(self.num_columns, length)
        self.layers = [
            (torch.cat([_left_pad(keys, width), _left_pad(row_keys, width)]),
             torch.cat([_left_pad(values, width), _left_pad(row_values, width)]))
            for (keys, values), (row_keys, row_values) in zip(self.layers, row)
        ]
        self.lengths.append(length)

    def keep(self, rows: Sequence[int]) -> None:
        """Keep only `rows` (in that order) and cut the leading columns no kept row uses."""
        if not rows:
            self.layers, self.lengths = [], []
            return
        self.lengths = [self.lengths[row] for row in rows]
        cut = self.num_columns - max(self.lengths)
        index = torch.tensor(list(rows), device=self.layers[0][0].device)
        self.layers = [(keys.index_select(0, index)[:, :, cut:], values.index_select(0, index)[:, :, cut:])
                       for keys, values in self.layers]

    def grow(self, layers: KV) -> None:
        """Take the cache a decode forward returned: one more column, a new token for every row."""
        if layers[0][0].shape[2] != self.num_columns + 1:
            raise ValueError(f"expected {self.num_columns + 1} columns after a decode step, got {layers[0][0].shape[2]}")
        self.layers = list(layers)
        self.lengths = [length + 1 for length in self.lengths]

    def attention_mask(self, new_columns: int = 1) -> torch.Tensor:
        """`[rows, columns + new_columns]`: 1 where a row holds a token (the new columns included)."""
        columns = torch.arange(self.num_columns + new_columns)
        first = torch.tensor([self.num_columns - length for length in self.lengths])
        return (columns[None, :] >= first[:, None]).long()

    def next_positions(self) -> torch.Tensor:
        """`[rows, 1]`: the position of each row's next token (its count of tokens so far)."""
        return torch.tensor(self.lengths, dtype=torch.long)[:, None]
