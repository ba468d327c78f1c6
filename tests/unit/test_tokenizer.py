import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import pytest  # noqa: E402

from baige_ray.models.tokenizer import (  # noqa: E402
    BOS_TOKEN,
    EOS_TOKEN,
    load_tokenizer,
    tokenizer_fingerprint,
    train_bpe_tokenizer,
)

_WORDS = "the quick brown fox jumps over a lazy dog while elastic workers train a tiny model on ray".split()


def write_corpus(directory, num_files=3, lines=30, seed=0):
    paths = []
    for file_index in range(num_files):
        text = "\n".join(
            " ".join(_WORDS[(seed + file_index * 7 + line * 3 + word) % len(_WORDS)] for word in range(10))
            for line in range(lines)
        )
        path = directory / f"doc{file_index}.txt"
        path.write_text(text + "\nnaïve café über 東京 🦊\n", encoding="utf-8")
        paths.append(path)
    return paths


@pytest.fixture(scope="module")
def corpus_files(tmp_path_factory):
    return write_corpus(tmp_path_factory.mktemp("corpus"))


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory, corpus_files):
    return train_bpe_tokenizer(corpus_files, tmp_path_factory.mktemp("tokenizer"), vocab_size=320)


def test_auto_tokenizer_loads_it_offline_and_round_trips(tokenizer_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir), local_files_only=True)
    text = "the lazy fox trains on ray: naïve café 東京 🦊 unseen-words 123"
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert tokenizer.decode(ids) == text
    assert len(tokenizer) == 320
    assert tokenizer.eos_token == tokenizer.pad_token == EOS_TOKEN
    assert tokenizer.bos_token == BOS_TOKEN
    assert tokenizer.eos_token_id == tokenizer.pad_token_id != tokenizer.bos_token_id


def test_load_tokenizer_matches_auto_tokenizer(tokenizer_dir):
    from transformers import AutoTokenizer

    loaded = load_tokenizer(tokenizer_dir)
    reference = AutoTokenizer.from_pretrained(str(tokenizer_dir), local_files_only=True)
    assert loaded.get_vocab() == reference.get_vocab()
    assert tokenizer_fingerprint(loaded) == tokenizer_fingerprint(reference)


def test_training_is_deterministic(tmp_path, corpus_files, tokenizer_dir):
    again = train_bpe_tokenizer(corpus_files, tmp_path / "again", vocab_size=320)
    assert (again / "tokenizer.json").read_bytes() == (tokenizer_dir / "tokenizer.json").read_bytes()
    assert tokenizer_fingerprint(load_tokenizer(again)) == tokenizer_fingerprint(load_tokenizer(tokenizer_dir))


def test_fingerprint_is_short_and_tells_vocabularies_apart(tmp_path, corpus_files, tokenizer_dir):
    fingerprint = tokenizer_fingerprint(load_tokenizer(tokenizer_dir))
    other = tokenizer_fingerprint(load_tokenizer(train_bpe_tokenizer(corpus_files, tmp_path, vocab_size=300)))
    assert len(fingerprint) == 16 and int(fingerprint, 16) >= 0
    assert other != fingerprint


@pytest.mark.parametrize(
    ("make_path", "message"),
    [
        (lambda root: root / "missing", "does not exist"),
        (lambda root: root, "holds no tokenizer files: expected tokenizer.json"),
        (lambda root: (root / "file.txt", (root / "file.txt").write_text("x"))[0], "is a file"),
    ],
)
def test_load_tokenizer_rejects_paths_without_a_tokenizer(tmp_path, make_path, message):
    with pytest.raises(ValueError, match=message):
        load_tokenizer(make_path(tmp_path))


def test_train_rejects_bad_input(tmp_path, corpus_files):
    with pytest.raises(ValueError, match="does not exist"):
        train_bpe_tokenizer([tmp_path / "missing.txt"], tmp_path / "out")
    with pytest.raises(ValueError, match="non-empty list"):
        train_bpe_tokenizer(str(corpus_files[0]), tmp_path / "out")
    with pytest.raises(ValueError, match="vocab_size=100 is invalid"):
        train_bpe_tokenizer(corpus_files, tmp_path / "out", vocab_size=100)
    with pytest.raises(ValueError, match="min_frequency=0 is invalid"):
        train_bpe_tokenizer(corpus_files, tmp_path / "out", min_frequency=0)
