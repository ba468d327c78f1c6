import numpy as np
import pytest
import torch

from baige_ray.engines.train_job import sample_range
from baige_ray.models.corpus import ByteCorpus, CorpusConfig, stdlib_corpus, stdlib_source_files


@pytest.fixture(scope="module")
def corpus() -> ByteCorpus:
    return stdlib_corpus(CorpusConfig(max_bytes=1 << 20))


def test_corpus_is_real_python_source(corpus):
    assert len(corpus) == 1 << 20
    text = corpus.decode(corpus.batch(range(4), 256, seed=0)[0].flatten())
    assert "def " in text or "import " in text or "class " in text


def test_source_files_skip_test_suites():
    files = stdlib_source_files()
    assert files and all("test" not in path.parts[-2:-1] for path in files)
    assert files == sorted(files)


def test_same_index_same_sample_in_any_order(corpus):
    forward_inputs, forward_targets = corpus.batch(range(10), 64, seed=3)
    backward_inputs, _ = corpus.batch(range(9, -1, -1), 64, seed=3)
    assert torch.equal(forward_inputs, backward_inputs.flip(0))
    assert torch.equal(forward_inputs[:, 1:], forward_targets[:, :-1])


def test_seed_changes_samples(corpus):
    assert not torch.equal(corpus.batch(range(8), 64, seed=0)[0], corpus.batch(range(8), 64, seed=1)[0])


@pytest.mark.parametrize("world_size", [1, 2, 4, 8])
def test_rank_slices_tile_the_global_batch_for_any_layout(corpus, world_size):
    step, batch = 5, 32
    per_rank = [corpus.batch(sample_range(step, r, world_size, batch), 32, seed=0)[0] for r in range(world_size)]
    whole = corpus.batch(range(step * batch, (step + 1) * batch), 32, seed=0)[0]
    assert torch.equal(torch.cat(per_rank), whole)


def test_train_and_validation_windows_do_not_overlap(corpus):
    train_offsets = corpus.sample_offsets(np.arange(2000), 128, seed=0, split="train")
    valid_offsets = corpus.sample_offsets(np.arange(2000), 128, seed=0, split="validation")
    assert train_offsets.max() + 129 <= valid_offsets.min()


def test_fingerprint_identifies_content():
    assert ByteCorpus(b"a" * 5000).fingerprint == ByteCorpus(b"a" * 5000).fingerprint
    assert ByteCorpus(b"a" * 5000).fingerprint != ByteCorpus(b"b" * 5000).fingerprint


def test_too_small_corpus_is_rejected(tmp_path):
    (tmp_path / "tiny.py").write_text("x = 1\n")
    with pytest.raises(ValueError, match="only 6 bytes"):
        ByteCorpus.from_stdlib(root=tmp_path)


def test_encode_decode_roundtrip(corpus):
    assert corpus.decode(corpus.encode("héllo")) == "héllo"
