"""PaddedKVBatch: rows join with their own cache and leave at any step, left-padded and trimmed."""

from __future__ import annotations

import pytest
import torch

from baige_ray.serving.kv_batch import PaddedKVBatch


def row(length: int, value: float, layers: int = 2):
    tensor = torch.full((1, 2, length, 4), value)
    return [(tensor, tensor + 100) for _ in range(layers)]


def test_rows_of_different_lengths_are_left_padded_and_masked():
    batch = PaddedKVBatch()
    batch.add(row(3, 1.0), 3)
    batch.add(row(5, 2.0), 5)
    assert batch.num_rows == 2 and batch.num_columns == 5
    keys = batch.layers[0][0]
    assert torch.equal(keys[0, 0, :, 0], torch.tensor([0, 0, 1, 1, 1.0]))
    assert batch.attention_mask(1).tolist() == [[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]]
    assert batch.next_positions().tolist() == [[3], [5]]


def test_a_decode_step_grows_every_row_and_leaving_rows_trim_padding():
    batch = PaddedKVBatch()
    batch.add(row(2, 1.0), 2)
    batch.add(row(6, 2.0), 6)
    grown = [(torch.cat([k, torch.full((2, 2, 1, 4), 9.0)], dim=2), v) for k, v in batch.layers]
    batch.grow(grown)
    assert batch.lengths == [3, 7] and batch.num_columns == 7
    batch.keep([0])  # the long row leaves: only the short row's 3 columns remain
    assert batch.num_columns == 3 and batch.lengths == [3]
    assert torch.equal(batch.layers[1][0][0, 0, :, 0], torch.tensor([1, 1, 9.0]))
    batch.keep([])
    assert batch.num_rows == 0 and batch.num_columns == 0


def test_a_joining_row_must_be_one_sequence_of_its_length():
    with pytest.raises(ValueError, match="one sequence of 4 columns"):
        PaddedKVBatch().add(row(3, 1.0), 4)
