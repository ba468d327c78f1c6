"""A decode step samples all its rows at once (models/generation.py): the same tokens and log-probabilities
as row by row, each row with its own generator."""

import pytest
import torch

from baige_ray.models.generation import sample_token, sample_tokens, seeded_generator, token_log_prob, tokens_log_probs


@pytest.mark.parametrize("temperature, top_k", [(1.0, None), (0.7, 40), (0.0, None), (1.3, 5)])
@pytest.mark.parametrize("rows, vocab", [(1, 384), (8, 512), (33, 151_936)])
def test_rows_sampled_together_draw_what_each_draws_alone(temperature, top_k, rows, vocab):
    logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(rows)) * 3
    seeds = [17 * row + 1 for row in range(rows)]
    alone = [sample_token(logits[row], temperature, seeded_generator(seed), top_k) for row, seed in enumerate(seeds)]
    together = sample_tokens(logits, temperature, [seeded_generator(seed) for seed in seeds], top_k)
    assert together == alone
    assert tokens_log_probs(logits, together) == [token_log_prob(logits[row], t) for row, t in enumerate(alone)]
