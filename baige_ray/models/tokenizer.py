"""Tokenizers for the user's causal LMs: train a small byte-level BPE offline, load one from disk,
turn local text files into token ids.

Everything here reads local files only; nothing reaches the Hugging Face hub. transformers, tokenizers
and datasets take seconds to import, so they are imported inside the functions: only the processes
that tokenize pay for them.
"""

from __future__ import annotations

import contextlib
import glob
import hashlib
import json
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from baige_ray.api.validation import require_int

if TYPE_CHECKING:
    from datasets import Dataset
    from transformers import PreTrainedTokenizerBase

EOS_TOKEN = "<|endoftext|>"
BOS_TOKEN = "<|begin_of_text|>"

# Any one of these makes a directory loadable by AutoTokenizer: fast JSON, SentencePiece or BPE/WordPiece vocab.
TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "tokenizer.model", "spiece.model", "vocab.json", "vocab.txt"
)
# File extension -> the datasets builder that reads it.
SUPPORTED_EXTENSIONS = {".txt": "text", ".jsonl": "json", ".json": "json", ".parquet": "parquet"}
_MAP_BATCH_SIZE = 1000
_SPECIAL_ID_NAMES = ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id")


def _text_files(files: Sequence[str | Path]) -> list[str]:
    if isinstance(files, (str, Path)) or not files:
        raise ValueError(f"train_bpe_tokenizer.files={files!r} is invalid: expected a non-empty list of text files")
    paths = [Path(file) for file in files]
    for path in paths:
        if not path.is_file():
            raise ValueError(f"train_bpe_tokenizer.files: {str(path)!r} does not exist or is not a file")
    return [str(path) for path in paths]


def train_bpe_tokenizer(
    files: Sequence[str | Path], directory: str | Path, *, vocab_size: int = 2048, min_frequency: int = 2
) -> Path:
    """Train a byte-level BPE on plain-text files and save it where AutoTokenizer loads it offline.

    The same files give the same tokenizer: the trainer breaks frequency ties by the pair itself.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    paths = _text_files(files)
    # 256 byte symbols plus the two special tokens are the floor: below it merges cannot even start.
    require_int("train_bpe_tokenizer", "vocab_size", vocab_size, minimum=258)
    require_int("train_bpe_tokenizer", "min_frequency", min_frequency, minimum=1)
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=[EOS_TOKEN, BOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train(paths, trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token=BOS_TOKEN, eos_token=EOS_TOKEN, pad_token=EOS_TOKEN
    )
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(str(directory))
    return directory


def load_tokenizer(path: str | Path, *, trust_remote_code: bool = False) -> PreTrainedTokenizerBase:
    """The tokenizer saved in a local directory, loaded by AutoTokenizer without touching the network."""
    from transformers import AutoTokenizer

    directory = Path(path)
    if not directory.exists():
        raise ValueError(f"tokenizer path {str(directory)!r} does not exist")
    if not directory.is_dir():
        raise ValueError(f"tokenizer path {str(directory)!r} is a file: expected the directory that holds it")
    if not any((directory / name).is_file() for name in TOKENIZER_FILES):
        raise ValueError(
            f"tokenizer directory {str(directory)!r} holds no tokenizer files: expected tokenizer.json, "
            f"or tokenizer_config.json with its vocabulary files (one of {', '.join(TOKENIZER_FILES)})"
        )
    try:
        return AutoTokenizer.from_pretrained(str(directory), trust_remote_code=trust_remote_code, local_files_only=True)
    except (OSError, ValueError, KeyError) as error:
        raise ValueError(f"tokenizer directory {str(directory)!r} could not be loaded: {error}") from error


def tokenizer_fingerprint(tokenizer: PreTrainedTokenizerBase) -> str:
    """A short hash of the vocabulary and special token ids: equal for tokenizers that give equal ids."""
    special = {name: getattr(tokenizer, name, None) for name in _SPECIAL_ID_NAMES}
    payload = {
        "vocab": sorted(tokenizer.get_vocab().items()),
        "special": special,
        "all_special_ids": sorted(tokenizer.all_special_ids),
    }
    encoded = json.dumps(payload, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    return hashlib.sha256(encoded).hexdigest()[:16]


def tokenize_file(
    path: str | Path, tokenizer: PreTrainedTokenizerBase, *, text_field: str, cache_dir: Path
) -> Iterator[tuple[np.ndarray, int]]:
    """A file's documents as flat token ids, each document followed by eos, batch by batch in row order.

    Yields (ids, number of documents in them). A .txt file is one document; a row of a .jsonl, .json or
    .parquet file is one, read from `text_field`. Hugging Face datasets reads and tokenizes, keeping its
    cache in `cache_dir`.
    """
    path = Path(path)
    if path.stat().st_size == 0:
        return
    num_ids = len(tokenizer)
    with _quiet_datasets():
        documents = _load_documents(path, text_field, cache_dir)
        column = documents.column_names[0]
        tokenized = documents.map(
            _tokenize_batch,
            batched=True,
            batch_size=_MAP_BATCH_SIZE,
            num_proc=None,
            remove_columns=documents.column_names,
            fn_kwargs={"tokenizer": tokenizer, "column": column, "path": path},
            # Naming the result spares datasets from pickling the tokenizer to hash it.
            new_fingerprint=hashlib.sha256(f"{path}\0{column}".encode()).hexdigest()[:32],
        )
    for table in tokenized.with_format("arrow").iter(batch_size=_MAP_BATCH_SIZE):
        column = table.column("input_ids").combine_chunks()
        ids = column.flatten().to_numpy(zero_copy_only=False)
        if ids.size and (ids.min() < 0 or ids.max() >= num_ids):
            raise ValueError(f"the tokenizer gave {path} ids outside [0, len(tokenizer)={num_ids})")
        yield ids, int(np.count_nonzero(column.value_lengths().to_numpy(zero_copy_only=False)))


@contextlib.contextmanager
def _quiet_datasets() -> Iterator[None]:
    """One progress bar per file and per map is noise; the caller's setting comes back afterwards."""
    from datasets.utils import logging as datasets_logging

    enabled = datasets_logging.is_progress_bar_enabled()
    datasets_logging.disable_progress_bar()
    try:
        yield
    finally:
        if enabled:
            datasets_logging.enable_progress_bar()


def load_rows(path: Path, cache_dir: Path) -> Dataset:
    """The file's rows (a .txt file: one row, the whole document) through Hugging Face `datasets`, its cache in
    `cache_dir`; a ValueError naming the file when it cannot be read."""
    from datasets import load_dataset

    kind = SUPPORTED_EXTENSIONS[path.suffix.lower()]
    options = {"sample_by": "document"} if kind == "text" else {}
    try:
        # datasets expands data_files as patterns, so a name like "shard[1].txt" must be escaped.
        pattern = glob.escape(str(path))
        return load_dataset(kind, data_files=[pattern], split="train", cache_dir=str(cache_dir), **options)
    except Exception as error:  # datasets raises many types for a malformed file; the user needs its name
        raise ValueError(f"{path} could not be read as {kind}: {error}") from error


def _load_documents(path: Path, text_field: str, cache_dir: Path) -> Dataset:
    documents = load_rows(path, cache_dir)
    if SUPPORTED_EXTENSIONS[path.suffix.lower()] == "text":
        return documents
    if text_field not in documents.column_names:
        raise ValueError(
            f"{path} has no {text_field!r} field (it has {', '.join(documents.column_names)}); "
            "pass text_field= to name the field that holds the text"
        )
    return documents.select_columns([text_field])


def _tokenize_batch(
    batch: dict[str, list], *, tokenizer: PreTrainedTokenizerBase, column: str, path: Path
) -> dict[str, list[list[int]]]:
    texts = batch[column]
    for text in texts:
        if not isinstance(text, str):
            raise ValueError(f"{path}: a row has {column}={text!r}; every row needs a string in {column!r}")
    encoded = tokenizer(texts, add_special_tokens=False, verbose=False)["input_ids"]
    eos = tokenizer.eos_token_id
    # Empty documents add nothing, not even eos: a lone eos would be a boundary with no document.
    return {"input_ids": [ids + [eos] if ids else [] for ids in encoded]}
