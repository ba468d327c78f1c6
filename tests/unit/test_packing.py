"""Packing documents without contamination: best-fit decreasing fills sequences tightly, and a document
packed after another scores exactly as it does alone (its positions restart, its attention stays inside it)."""

import numpy as np
import pytest
import torch

from baige_ray.models.packing import best_fit_decreasing, restarting_positions


def test_best_fit_decreasing_fills_the_tightest_bin_and_keeps_every_document():
    lengths = [5, 9, 3, 7, 2, 10, 1, 4]
    bins = best_fit_decreasing(lengths, capacity=10)
    assert sorted(index for members in bins for index in members) == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in members) <= 10 for members in bins)
    assert len(bins) == 5 == -(-sum(lengths) // 10)  # 41 tokens: no packing does better than 5 bins
    # Longest first: 10, 9, 7 and 5 each open a bin; 4 takes the tightest room (5's), 3 fills 7's; 2 fits
    # nowhere and opens the fifth; 1 fills 9's, the tightest room left (1, against 8)
    assert bins == [[0, 7], [1, 6], [2, 3], [4], [5]]
    with pytest.raises(ValueError, match="every length must be in 1..10"):
        best_fit_decreasing([11], capacity=10)


def test_positions_restart_at_each_document():
    np.testing.assert_array_equal(restarting_positions([3, 1, 2]), [0, 1, 2, 0, 0, 1])


@pytest.mark.parametrize("family", ["llama_config", "qwen2_tied_config", "mixtral_config"])
def test_a_document_packed_after_another_scores_as_it_does_alone(tmp_path, family):
    from transformers import AutoModelForCausalLM

    import tests.hf_helpers as hf_helpers
    from baige_ray.models.hf import HFModel
    from baige_ray.models.plugin import plugin_for

    config = getattr(hf_helpers, family)()
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(tmp_path)
    plugin = plugin_for(HFModel(tmp_path, seq_len=32))
    (stage,) = plugin.build_stages([(0, config.num_hidden_layers, True, True)], torch.device("cpu"), seed=0)
    stage.eval()
    generator = torch.Generator().manual_seed(1)
    probe, before = (torch.randint(0, config.vocab_size, (1, n), generator=generator) for n in (11, 21))
    packed_positions = torch.from_numpy(restarting_positions([21, 11])).unsqueeze(0)
    with torch.no_grad():
        alone = stage(probe)
        packed = stage(torch.cat([before, probe], dim=1), positions=packed_positions)[:, 21:]
        unmasked = stage(torch.cat([before, probe], dim=1))[:, 21:]
    torch.testing.assert_close(packed, alone, rtol=1e-5, atol=1e-5)
    assert (unmasked - alone).abs().max() > 1e-2, "without positions the probe sees the document before it"


def test_pretraining_text_with_document_masking_restarts_positions_after_each_eos(tmp_path):
    from baige_ray.models.plugin import IGNORE_INDEX
    from baige_ray.models.token_dataset import TokenDataset
    from baige_ray.models.tokenizer import load_tokenizer, train_bpe_tokenizer
    from tests.hf_helpers import text_files

    tokenizer_dir = train_bpe_tokenizer(text_files(tmp_path / "corpus"), tmp_path / "tokenizer", vocab_size=384)
    eos = load_tokenizer(tokenizer_dir).eos_token_id
    documents = []
    for index, words in enumerate((3, 40, 5, 9, 60, 2, 7)):
        documents.append(tmp_path / f"doc{index}.txt")
        documents[-1].write_text(" ".join(["token"] * words))
    build = dict(tokenizer=tokenizer_dir, seq_len=24, directory=tmp_path / "data")
    plain = TokenDataset.build(documents, **build)
    masked = TokenDataset.build(documents, **build, document_masking=True)
    assert masked.packs_documents and not plain.packs_documents and masked.fingerprint != plain.fingerprint
    everything = range(masked.num_sequences)
    inputs, targets = masked.batch(everything, 0)
    positions = masked.positions(everything, 0)
    assert torch.equal(inputs, plain.batch(everything, 0)[0]) and plain.positions(everything, 0) is None
    for row, row_positions, row_targets in zip(inputs, positions, targets):
        expected, position = [], 0
        for at, token in enumerate(row.tolist()):
            expected.append(position)
            position = 0 if token == eos else position + 1
            assert (row_targets[at] == IGNORE_INDEX) == (token == eos)
        assert row_positions.tolist() == expected
    assert masked.trained_tokens(everything, 0) == int((targets != IGNORE_INDEX).sum()) < plain.trained_tokens(
        everything, 0)
