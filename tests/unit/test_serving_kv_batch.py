"""PagedKVBatch: rows join with their own cache and leave at any step; keys and values live in blocks of a
pool, and the view attention runs on is left-padded and trimmed as a dense batch would be."""

from __future__ import annotations

import pytest
import torch

from baige_ray.serving.kv_batch import PagedKVBatch

HEADS, DIM = 2, 4


def row(length: int, value: float, layers: int = 2):
    keys = value + torch.arange(length, dtype=torch.float32).reshape(1, 1, length, 1).expand(1, HEADS, length, DIM)
    return [(keys.clone(), keys + 100) for _ in range(layers)]


def decode_step(batch: PagedKVBatch, value: float):
    """What a decode forward returns: the view with one more column, `value` for every row."""
    return [(torch.cat([k, torch.full((batch.num_rows, HEADS, 1, DIM), value)], dim=2),
             torch.cat([v, torch.full((batch.num_rows, HEADS, 1, DIM), value + 100)], dim=2)) for k, v in batch.layers]


def test_rows_of_different_lengths_are_left_padded_and_masked():
    batch = PagedKVBatch(block_tokens=2)
    batch.add(row(3, 1.0), 3)
    batch.add(row(5, 10.0), 5)
    assert batch.num_rows == 2 and batch.num_columns == 5
    keys = batch.layers[0][0]
    assert keys[0, 0, :, 0].tolist() == [0, 0, 1, 2, 3] and keys[1, 1, :, 3].tolist() == [10, 11, 12, 13, 14]
    assert batch.attention_mask(1).tolist() == [[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]]
    assert batch.next_positions().tolist() == [[3], [5]]
    assert [len(table) for table in batch.tables] == [2, 3]  # ceil(length / block): one partly filled each


def test_copies_of_one_prefilled_row_each_get_blocks_of_their_own():
    batch = PagedKVBatch(block_tokens=2)
    batch.add(row(1, 5.0), 1)
    batch.add(row(3, 1.0), 3, copies=3)
    assert batch.num_rows == 4 and batch.lengths == [1, 3, 3, 3]
    tables = batch.tables[1:]
    assert len({block for table in tables for block in table}) == 6  # two blocks each, none shared
    assert all(batch.row(index)[1][1][0, 1, :, 2].tolist() == [101, 102, 103] for index in (1, 2, 3))
    batch.grow(decode_step(batch, 9.0))
    assert batch.layers[0][0][:, 0, :, 0].tolist() == [[0, 0, 5, 9], [1, 2, 3, 9], [1, 2, 3, 9], [1, 2, 3, 9]]
    with pytest.raises(ValueError, match="copies"):
        batch.add(row(2, 1.0), 2, copies=0)


def test_a_decode_step_writes_one_slot_per_row_and_a_full_block_asks_for_a_new_one():
    batch = PagedKVBatch(block_tokens=2)
    batch.add(row(2, 1.0), 2)  # its block is full: the next token needs a new one
    batch.add(row(3, 10.0), 3)
    batch.grow(decode_step(batch, 9.0))
    assert batch.lengths == [3, 4] and [len(table) for table in batch.tables] == [2, 2]
    assert batch.layers[1][0][0, 0, :, 0].tolist() == [0, 1, 2, 9]
    assert batch.row(1)[0][1][0, 0, :, 0].tolist() == [110, 111, 112, 109]
    with pytest.raises(ValueError, match="expected 5 columns"):
        batch.grow(batch.layers)


def test_leaving_rows_free_their_blocks_for_the_next_and_the_view_is_trimmed():
    batch = PagedKVBatch(block_tokens=2)
    batch.add(row(2, 1.0), 2)
    batch.add(row(7, 10.0), 7)
    in_use = batch.blocks_in_use
    batch.keep([0])  # the long row leaves: only the short row's 2 columns remain
    assert batch.num_columns == 2 and batch.lengths == [2] and batch.blocks_in_use == 1
    batch.add(row(6, 20.0), 6)  # reuses the freed blocks: the pool does not grow
    assert batch.blocks_in_use == in_use - 1 and batch.num_blocks == 8
    assert batch.layers[0][0][1, 0, :, 0].tolist() == [20, 21, 22, 23, 24, 25]
    batch.keep([])
    assert batch.num_rows == 0 and batch.num_columns == 0 and batch.layers == []


def test_the_pool_doubles_when_its_blocks_are_taken_and_rows_keep_their_numbers():
    batch = PagedKVBatch(block_tokens=2)
    batch.add(row(13, 1.0), 13)  # 7 blocks: the whole first pool but its padding block
    batch.add(row(4, 50.0), 4)
    assert batch.num_blocks == 16
    assert batch.row(0)[1][0][0, 0, :, 0].tolist() == list(range(1, 14))
    assert batch.row(1)[1][1][0, 1, :, 2].tolist() == [150, 151, 152, 153]


def test_a_joining_row_must_be_one_sequence_of_its_length():
    with pytest.raises(ValueError, match="one sequence of 4 columns"):
        PagedKVBatch().add(row(3, 1.0), 4)
    with pytest.raises(ValueError, match="PagedKVBatch.block_tokens"):
        PagedKVBatch(block_tokens=0)
