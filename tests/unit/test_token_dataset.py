import json
import os
import pickle

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import numpy as np  # noqa: E402
import pyarrow as pa  # noqa: E402
import pyarrow.parquet as pq  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

from baige_ray.models import token_dataset  # noqa: E402
from baige_ray.models.token_dataset import METADATA_FILE, TOKENS_FILE, TokenDataset  # noqa: E402
from baige_ray.models.tokenizer import load_tokenizer, tokenizer_fingerprint, train_bpe_tokenizer  # noqa: E402

_WORDS = "the quick brown fox jumps over a lazy dog while elastic workers train a tiny model on ray".split()


def make_text(seed: int, num_lines: int = 12) -> str:
    return "\n".join(
        " ".join(_WORDS[(seed * 5 + line * 3 + word) % len(_WORDS)] for word in range(8)) for line in range(num_lines)
    )


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("tokenizer")
    files = []
    for index in range(3):
        files.append(root / f"train{index}.txt")
        files[-1].write_text(make_text(index, num_lines=40) + "\nnaïve café 東京\n", encoding="utf-8")
    return train_bpe_tokenizer(files, root / "tokenizer", vocab_size=320)


@pytest.fixture(scope="module")
def tokenizer(tokenizer_dir):
    return load_tokenizer(tokenizer_dir)


def packed(tokenizer, documents: list[str]) -> list[int]:
    """What the dataset should hold, tokenized by hand: each document's ids, then eos."""
    tokens = []
    for document in documents:
        ids = tokenizer(document, add_special_tokens=False)["input_ids"]
        tokens.extend(ids + [tokenizer.eos_token_id] if ids else [])
    return tokens


def stored_tokens(dataset: TokenDataset) -> np.ndarray:
    return np.fromfile(dataset.directory / TOKENS_FILE, dtype=dataset.metadata.dtype)


def expect_packing(dataset: TokenDataset, expected: list[int], seq_len: int) -> None:
    width = seq_len + 1
    assert dataset.seq_len == seq_len
    assert dataset.num_sequences == len(expected) // width
    assert stored_tokens(dataset).tolist() == expected[: dataset.num_sequences * width]
    assert dataset.metadata.num_dropped_tokens == len(expected) % width


def write_txt(directory, documents: list[str]) -> list:
    paths = []
    for index, document in enumerate(documents):
        paths.append(directory / f"part{index:02d}.txt")
        paths[-1].write_text(document, encoding="utf-8")
    return paths


@pytest.fixture
def txt_dataset(tmp_path, tokenizer_dir):
    write_txt(tmp_path, [make_text(seed) for seed in range(4)])
    return TokenDataset.build([tmp_path / "*.txt"], tokenizer=tokenizer_dir, seq_len=16, directory=tmp_path / "out")


def test_txt_files_are_one_document_each_packed_in_file_order(tmp_path, tokenizer, tokenizer_dir):
    documents = [make_text(seed) + "\n\nsecond paragraph\n" for seed in range(3)]
    write_txt(tmp_path, documents + [""])
    dataset = TokenDataset.build(str(tmp_path / "part*.txt"), tokenizer=tokenizer, seq_len=16, directory=tmp_path / "o")
    expect_packing(dataset, packed(tokenizer, documents), seq_len=16)
    assert dataset.metadata.num_documents == 3
    assert dataset.metadata.dtype == "uint16"
    assert dataset.vocab_size == len(tokenizer) == 320
    assert dataset.tokenizer_fingerprint == tokenizer_fingerprint(tokenizer)
    assert sorted(path.name for path in dataset.directory.iterdir()) == [METADATA_FILE, TOKENS_FILE]


def test_jsonl_rows_are_documents_read_from_the_text_field(tmp_path, tokenizer, tokenizer_dir):
    rows = [{"id": index, "body": make_text(index, num_lines=3)} for index in range(6)]
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    dataset = TokenDataset.build(
        [tmp_path / "rows.jsonl"], tokenizer=tokenizer_dir, seq_len=8, directory=tmp_path / "o", text_field="body"
    )
    expect_packing(dataset, packed(tokenizer, [row["body"] for row in rows]), seq_len=8)
    assert dataset.metadata.num_documents == 6


def test_parquet_and_mixed_sources_keep_the_given_order(tmp_path, tokenizer, tokenizer_dir):
    texts = [make_text(index, num_lines=2) for index in range(5)]
    pq.write_table(pa.table({"text": texts[:3], "score": [1.0, 2.0, 3.0]}), tmp_path / "a.parquet")
    (tmp_path / "b.jsonl").write_text("".join(json.dumps({"text": text}) + "\n" for text in texts[3:]))
    (tmp_path / "c.txt").write_text(make_text(9))
    files = [tmp_path / "c.txt", tmp_path / "a.parquet", tmp_path / "b.jsonl"]
    dataset = TokenDataset.build(files, tokenizer=tokenizer_dir, seq_len=12, directory=tmp_path / "o")
    expect_packing(dataset, packed(tokenizer, [make_text(9)] + texts), seq_len=12)
    assert [source.path for source in dataset.metadata.sources] == [str(path.resolve()) for path in files]


def test_batch_targets_are_inputs_shifted_by_one(txt_dataset):
    inputs, targets = txt_dataset.batch(range(6), seed=3)
    assert inputs.shape == targets.shape == (6, 16)
    assert inputs.dtype == targets.dtype == torch.int64
    rows = stored_tokens(txt_dataset).reshape(-1, 17)[txt_dataset.sequence_ids(range(6), seed=3)]
    assert torch.equal(inputs, torch.from_numpy(rows[:, :-1].astype(np.int64)))
    assert torch.equal(targets, torch.from_numpy(rows[:, 1:].astype(np.int64)))


def test_batch_is_deterministic_in_any_order_and_any_process(txt_dataset):
    inputs, targets = txt_dataset.batch([5, 0, 77, 3], seed=11)
    copy = pickle.loads(pickle.dumps(txt_dataset))
    token_dataset._map_tokens.cache_clear()
    token_dataset._permutation.cache_clear()
    again_inputs, again_targets = copy.batch(np.array([3, 77, 0, 5]), seed=11)
    assert torch.equal(inputs, again_inputs.flip(0)) and torch.equal(targets, again_targets.flip(0))
    assert not torch.equal(txt_dataset.batch(range(8), seed=1)[0], txt_dataset.batch(range(8), seed=2)[0])


def test_each_epoch_visits_every_sequence_once_in_a_new_order(txt_dataset):
    count = txt_dataset.num_sequences
    first = txt_dataset.sequence_ids(range(count), seed=0)
    second = txt_dataset.sequence_ids(range(count, 2 * count), seed=0)
    assert sorted(first.tolist()) == sorted(second.tolist()) == list(range(count))
    assert first.tolist() != second.tolist()
    inputs, _ = txt_dataset.batch(range(count), seed=0)
    assert sorted(map(tuple, inputs.tolist())) == sorted(
        map(tuple, stored_tokens(txt_dataset).reshape(count, -1)[:, :-1].tolist())
    )


def test_pickle_holds_metadata_not_the_memory_map(txt_dataset):
    txt_dataset.batch(range(4), seed=0)
    payload = pickle.dumps(txt_dataset)
    assert len(payload) < 4096 and b"memmap" not in payload
    copy = pickle.loads(payload)
    assert copy == txt_dataset and copy.fingerprint == txt_dataset.fingerprint
    assert vars(copy).keys() == {"directory", "metadata", "document_masking"}


def test_rebuilding_the_same_inputs_reuses_the_directory(tmp_path, tokenizer_dir, txt_dataset):
    tokens, metadata = txt_dataset.directory / TOKENS_FILE, txt_dataset.directory / METADATA_FILE
    before = (tokens.stat().st_mtime_ns, metadata.stat().st_mtime_ns)
    again = TokenDataset.build([tmp_path / "*.txt"], tokenizer=tokenizer_dir, seq_len=16, directory=tmp_path / "out")
    assert again == txt_dataset
    assert (tokens.stat().st_mtime_ns, metadata.stat().st_mtime_ns) == before
    assert TokenDataset.open(tmp_path / "out") == txt_dataset


def test_sources_written_again_with_the_same_text_reuse_the_dataset_and_new_text_rebuilds_it(
        tmp_path, tokenizer_dir, txt_dataset, caplog):
    files, tokens = [tmp_path / "*.txt"], txt_dataset.directory / TOKENS_FILE
    before = tokens.stat().st_mtime_ns
    for path in sorted(tmp_path.glob("*.txt")):  # as a second `make demo` writes its documents again
        path.write_text(path.read_text())
    assert TokenDataset.build(files, tokenizer=tokenizer_dir, seq_len=16, directory=tmp_path / "out") == txt_dataset
    assert tokens.stat().st_mtime_ns == before
    (tmp_path / "part00.txt").write_text("changed text, a fox jumps " * 20)
    with caplog.at_level("WARNING"):
        rebuilt = TokenDataset.build(files, tokenizer=tokenizer_dir, seq_len=16, directory=tmp_path / "out")
    assert "contents of 1 source file(s) changed (part00.txt)" in caplog.text
    assert rebuilt.fingerprint != txt_dataset.fingerprint


def test_a_different_build_needs_overwrite(tmp_path, tokenizer_dir, txt_dataset):
    files = [tmp_path / "*.txt"]
    with pytest.raises(ValueError, match="seq_len 16 != 8.*overwrite=True"):
        TokenDataset.build(files, tokenizer=tokenizer_dir, seq_len=8, directory=tmp_path / "out")
    rebuilt = TokenDataset.build(files, tokenizer=tokenizer_dir, seq_len=8, directory=tmp_path / "out", overwrite=True)
    assert rebuilt.seq_len == 8 and rebuilt.fingerprint != txt_dataset.fingerprint


def test_open_detects_corruption_and_build_repairs_it(tmp_path, tokenizer_dir, txt_dataset):
    tokens = txt_dataset.directory / TOKENS_FILE
    original = tokens.read_bytes()
    tokens.write_bytes(bytes([original[0] ^ 1]) + original[1:])
    with pytest.raises(ValueError, match="tokens.bin fails its SHA-256 check.*rebuild it with TokenDataset.build"):
        TokenDataset.open(txt_dataset.directory)
    assert TokenDataset.open(txt_dataset.directory, verify=False).num_sequences == txt_dataset.num_sequences
    repaired = TokenDataset.build([tmp_path / "*.txt"], tokenizer=tokenizer_dir, seq_len=16, directory=tmp_path / "out")
    assert tokens.read_bytes() == original and repaired == txt_dataset


def test_open_detects_truncation_and_unfinished_builds(tmp_path, txt_dataset):
    tokens = txt_dataset.directory / TOKENS_FILE
    tokens.write_bytes(tokens.read_bytes()[:-2])
    with pytest.raises(ValueError, match="truncated"):
        TokenDataset.open(txt_dataset.directory, verify=False)
    (txt_dataset.directory / METADATA_FILE).unlink()
    with pytest.raises(ValueError, match="holds no dataset.json"):
        TokenDataset.open(txt_dataset.directory)
    with pytest.raises(ValueError, match="does not exist"):
        TokenDataset.open(tmp_path / "nowhere")


def build(tmp_path, tokenizer_dir, files, **options):
    options = {"seq_len": 8, "directory": tmp_path / "out", **options}
    return TokenDataset.build(files, tokenizer=tokenizer_dir, **options)


def test_rejects_missing_unmatched_and_unsupported_files(tmp_path, tokenizer_dir):
    (tmp_path / "notes.csv").write_text("text\nhello\n")
    with pytest.raises(ValueError, match="'.*missing.txt' does not exist"):
        build(tmp_path, tokenizer_dir, [tmp_path / "missing.txt"])
    with pytest.raises(ValueError, match="pattern .* matches no file"):
        build(tmp_path, tokenizer_dir, [tmp_path / "*.jsonl"])
    with pytest.raises(ValueError, match=r"unsupported extension '.csv': expected one of .txt, .jsonl, .json, .parq"):
        build(tmp_path, tokenizer_dir, [tmp_path / "notes.csv"])
    with pytest.raises(ValueError, match="is a directory"):
        build(tmp_path, tokenizer_dir, [tmp_path])
    with pytest.raises(ValueError, match="at least one file"):
        build(tmp_path, tokenizer_dir, [])


def test_rejects_records_without_the_text_field(tmp_path, tokenizer_dir):
    (tmp_path / "rows.jsonl").write_text('{"content": "a fox"}\n')
    with pytest.raises(ValueError, match="rows.jsonl has no 'text' field \\(it has content\\)"):
        build(tmp_path, tokenizer_dir, [tmp_path / "rows.jsonl"])
    pq.write_table(pa.table({"content": ["a fox"]}), tmp_path / "rows.parquet")
    with pytest.raises(ValueError, match="rows.parquet has no 'text' field"):
        build(tmp_path, tokenizer_dir, [tmp_path / "rows.parquet"])
    (tmp_path / "nulls.jsonl").write_text('{"text": "a fox"}\n{"text": null}\n')
    with pytest.raises(ValueError, match="a row has text=None"):
        build(tmp_path, tokenizer_dir, [tmp_path / "nulls.jsonl"])


def test_rejects_too_little_text(tmp_path, tokenizer, tokenizer_dir):
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(ValueError, match="yield no tokens"):
        build(tmp_path, tokenizer_dir, [tmp_path / "empty.txt", tmp_path / "empty.jsonl"])
    (tmp_path / "short.txt").write_text("the fox")
    count = len(packed(tokenizer, ["the fox"]))
    with pytest.raises(ValueError, match=f"yield {count} tokens .* seq_len=64 needs 65"):
        build(tmp_path, tokenizer_dir, [tmp_path / "short.txt"], seq_len=64)


def test_rejects_bad_arguments(tmp_path, tokenizer_dir, txt_dataset):
    with pytest.raises(ValueError, match="seq_len=0 is invalid"):
        build(tmp_path, tokenizer_dir, [tmp_path / "*.txt"], seq_len=0)
    with pytest.raises(ValueError, match="tokenizer path .* does not exist"):
        TokenDataset.build([tmp_path / "*.txt"], tokenizer=tmp_path / "no-tokenizer", seq_len=8, directory=tmp_path)
    with pytest.raises(ValueError, match="indices"):
        txt_dataset.batch([0, -1], seed=0)
    with pytest.raises(ValueError, match="seed=-1 is invalid"):
        txt_dataset.batch([0], seed=-1)


def test_a_file_named_like_a_pattern_is_read_as_itself(tmp_path, tokenizer, tokenizer_dir):
    (tmp_path / "shard[1].txt").write_text(make_text(3))
    dataset = build(tmp_path, tokenizer_dir, [tmp_path / "shard[1].txt"])
    expect_packing(dataset, packed(tokenizer, [make_text(3)]), seq_len=8)
