"""Packed token sequences for causal-LM training, built from local files through the model's tokenizer.

A document (a .txt file, or one row of a .jsonl/.json/.parquet file) is tokenized with Hugging Face
`datasets`, followed by eos, concatenated in file and row order and cut into sequences of
seq_len + 1 tokens. The sequences live in one flat memory-mapped file, so any rank reads any global
sample index without loading the rest, and a permutation drawn from (seed, epoch) orders each epoch.
"""

from __future__ import annotations

import dataclasses
import functools
import glob
import json
import logging
import shutil
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, BinaryIO

import numpy as np
import torch
from tqdm.auto import tqdm

from baige_ray.api.validation import require_choice, require_int
from baige_ray.checkpoint.files import fsync_path, sha256_file, write_json_atomically
from baige_ray.models.plugin import IGNORE_INDEX
from baige_ray.models.tokenizer import SUPPORTED_EXTENSIONS, load_tokenizer, tokenize_file, tokenizer_fingerprint

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

FORMAT_VERSION = 1
TOKENS_FILE = "tokens.bin"
METADATA_FILE = "dataset.json"
_GLOB_CHARACTERS = frozenset("*?[")


@dataclass(kw_only=True, frozen=True)
class SourceFile:
    """One input file as it was when the dataset was built: its contents' hash, not its modification
    time, says whether the tokens are stale (a file written again with the same text is not)."""

    path: str
    size: int
    sha256: str = ""  # "" in a dataset built before contents were hashed: rebuilt once

    def __post_init__(self) -> None:
        require_int("SourceFile", "size", self.size, minimum=0)

    @classmethod
    def of(cls, path: Path) -> SourceFile:
        return cls(path=str(path), size=path.stat().st_size, sha256=sha256_file(path))

    @classmethod
    def from_json(cls, data: dict) -> SourceFile:
        return cls(path=data["path"], size=data["size"], sha256=data.get("sha256", ""))


@dataclass(kw_only=True, frozen=True)
class TokenDatasetMetadata:
    """The contents of dataset.json."""

    format_version: int
    seq_len: int
    num_sequences: int
    num_tokens: int
    num_documents: int
    num_dropped_tokens: int
    dtype: str
    vocab_size: int
    eos_token_id: int
    tokenizer: str
    tokenizer_fingerprint: str
    text_field: str
    sources: tuple[SourceFile, ...] = dataclasses.field(repr=False)
    tokens_sha256: str

    def __post_init__(self) -> None:
        owner = "TokenDatasetMetadata"
        require_choice(owner, "format_version", self.format_version, (FORMAT_VERSION,))
        require_int(owner, "seq_len", self.seq_len, minimum=1)
        require_int(owner, "num_sequences", self.num_sequences, minimum=1)
        require_int(owner, "vocab_size", self.vocab_size, minimum=1)
        require_choice(owner, "dtype", self.dtype, ("uint16", "uint32"))
        if self.num_tokens != self.num_sequences * (self.seq_len + 1):
            raise ValueError(
                f"{owner}.num_tokens={self.num_tokens!r} is invalid: expected num_sequences * (seq_len + 1) "
                f"= {self.num_sequences * (self.seq_len + 1)}"
            )

    @classmethod
    def from_json(cls, data: dict) -> TokenDatasetMetadata:
        sources = tuple(SourceFile.from_json(source) for source in data["sources"])
        return cls(**{**data, "sources": sources})

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    def differences(
        self, *, fingerprint: str, seq_len: int, text_field: str
    ) -> list[str]:
        """What differs between this dataset's settings and a build request's; empty when they agree."""
        found = []
        if seq_len != self.seq_len:
            found.append(f"seq_len {self.seq_len} != {seq_len}")
        if fingerprint != self.tokenizer_fingerprint:
            found.append(f"tokenizer fingerprint {self.tokenizer_fingerprint} != {fingerprint}")
        if text_field != self.text_field:
            found.append(f"text_field {self.text_field!r} != {text_field!r}")
        return found

    def changed_sources(self, sources: tuple[SourceFile, ...]) -> str | None:
        """Why the tokens no longer match `sources` (None: same files, same contents)."""
        if [s.path for s in sources] != [s.path for s in self.sources]:
            return "the list of source files changed"
        changed = [Path(new.path).name for new, old in zip(sources, self.sources) if new != old]
        if changed:
            return f"the contents of {len(changed)} source file(s) changed ({', '.join(changed[:3])})"
        return None


@dataclass(kw_only=True, frozen=True)
class TokenDataset:
    """A finished dataset directory: small and picklable; each process maps tokens.bin on first read.

    `document_masking`: a token attends only to its own document, and positions restart at each (Llama 3's
    pre-training): documents end with eos, so each sequence's documents are found where eos falls, and the
    token after an eos (the next document's first) is no target. It is how the tokens are read, not what
    is stored: the same directory serves both."""

    directory: Path
    metadata: TokenDatasetMetadata
    document_masking: bool = False

    @property
    def seq_len(self) -> int:
        return self.metadata.seq_len

    @property
    def num_sequences(self) -> int:
        return self.metadata.num_sequences

    @property
    def vocab_size(self) -> int:
        return self.metadata.vocab_size

    @property
    def tokenizer_fingerprint(self) -> str:
        return self.metadata.tokenizer_fingerprint

    @property
    def fingerprint(self) -> str:
        return self.metadata.tokens_sha256[:16] + ("-documents" if self.document_masking else "")

    @property
    def packs_documents(self) -> bool:
        return self.document_masking

    def __len__(self) -> int:
        return self.num_sequences

    @classmethod
    def build(
        cls,
        files: Sequence[str | Path] | str | Path,
        *,
        tokenizer: str | Path | PreTrainedTokenizerBase,
        seq_len: int,
        directory: str | Path,
        text_field: str = "text",
        overwrite: bool = False,
        document_masking: bool = False,
    ) -> TokenDataset:
        """Tokenize and pack `files` into `directory`, or reuse the dataset already built there from them
        (`document_masking`: see the class)."""
        require_int("TokenDataset.build", "seq_len", seq_len, minimum=1)
        if not isinstance(text_field, str) or not text_field:
            raise ValueError(f"TokenDataset.build.text_field={text_field!r} is invalid: expected a non-empty string")
        paths = expand_files(files)
        tokenizer, tokenizer_name = resolve_tokenizer(tokenizer)
        sources = tuple(SourceFile.of(path) for path in paths)
        directory = Path(directory)
        if (directory / METADATA_FILE).exists() and not overwrite:
            reused = cls._reuse(directory, sources, tokenizer_fingerprint(tokenizer), seq_len, text_field)
            if reused is not None:
                return dataclasses.replace(reused, document_masking=document_masking)
        metadata = _build_directory(directory, paths, sources, tokenizer, tokenizer_name, seq_len, text_field)
        return cls(directory=directory.resolve(), metadata=metadata, document_masking=document_masking)

    @classmethod
    def _reuse(
        cls, directory: Path, sources: tuple[SourceFile, ...], fingerprint: str, seq_len: int, text_field: str
    ) -> TokenDataset | None:
        metadata = _read_metadata(directory)
        differences = metadata.differences(fingerprint=fingerprint, seq_len=seq_len, text_field=text_field)
        if differences:
            raise ValueError(
                f"{directory} already holds a dataset built differently ({'; '.join(differences)}); "
                "pass overwrite=True to replace it, or choose another directory"
            )
        if (changed := metadata.changed_sources(sources)) is not None:
            logger.warning("rebuilding the dataset in %s: %s", directory, changed)
            return None
        try:
            return cls.open(directory, verify=True)
        except ValueError as error:
            logger.warning("rebuilding the dataset in %s: %s", directory, error)
            return None

    @classmethod
    def open(cls, directory: str | Path, *, verify: bool = True, document_masking: bool = False) -> TokenDataset:
        """A finished dataset; `verify` re-hashes tokens.bin (seconds per GB) to catch silent corruption."""
        directory = Path(directory)
        if not directory.is_dir():
            raise ValueError(f"dataset directory {str(directory)!r} does not exist")
        metadata = _read_metadata(directory)
        tokens = directory / TOKENS_FILE
        if not tokens.is_file():
            raise ValueError(f"{tokens} is missing: the dataset is incomplete; rebuild it with TokenDataset.build")
        expected = metadata.num_tokens * np.dtype(metadata.dtype).itemsize
        if (actual := tokens.stat().st_size) != expected:
            raise ValueError(
                f"{tokens} holds {actual} bytes but {METADATA_FILE} expects {expected}: the dataset is truncated "
                "or corrupted; rebuild it with TokenDataset.build"
            )
        if verify and sha256_file(tokens) != metadata.tokens_sha256:
            raise ValueError(
                f"{tokens} fails its SHA-256 check: the dataset is corrupted; rebuild it with TokenDataset.build"
            )
        return cls(directory=directory.resolve(), metadata=metadata, document_masking=document_masking)

    def sequence_ids(self, indices: np.ndarray | range | Sequence[int], seed: int) -> np.ndarray:
        """The packed sequence each global sample index reads: epoch i // n visits a permutation of all n."""
        return global_sequence_ids(indices, self.num_sequences, seed, owner="TokenDataset")

    def batch(self, indices: np.ndarray | range | Sequence[int], seed: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Inputs and next-token targets, int64 of shape (len(indices), seq_len), for global sample indices."""
        rows = self._tokens()[self.sequence_ids(indices, seed)]
        tokens = torch.from_numpy(rows.astype(np.int64))
        inputs, targets = tokens[:, :-1], tokens[:, 1:]
        if self.document_masking:  # after an eos comes another document, which nothing before it predicts
            targets = targets.masked_fill(inputs == self.metadata.eos_token_id, IGNORE_INDEX)
        return inputs, targets

    def positions(self, indices: np.ndarray | range | Sequence[int], seed: int) -> torch.Tensor | None:
        """With document masking, each input token's position in its document (0 after every eos and at
        a sequence's start); None otherwise."""
        if not self.document_masking:
            return None
        inputs = self._tokens()[self.sequence_ids(indices, seed)][:, :-1]
        starts = np.zeros(inputs.shape, dtype=bool)
        starts[:, 0] = True
        starts[:, 1:] = inputs[:, :-1] == self.metadata.eos_token_id
        index = np.broadcast_to(np.arange(inputs.shape[1]), inputs.shape)
        last_start = np.maximum.accumulate(np.where(starts, index, 0), axis=1)
        return torch.from_numpy((index - last_start).astype(np.int64))

    def trained_tokens(self, indices: np.ndarray | range | Sequence[int], seed: int) -> int:
        """The tokens samples `indices` train: every target of plain text, but with document masking the
        first token of each document after an eos."""
        total = len(indices) * self.seq_len
        if not self.document_masking:
            return total
        inputs = self._tokens()[self.sequence_ids(indices, seed)][:, :-1]
        return total - int((inputs == self.metadata.eos_token_id).sum())

    def _tokens(self) -> np.memmap:
        metadata = self.metadata
        shape = (metadata.num_sequences, metadata.seq_len + 1)
        return _map_tokens(str(self.directory / TOKENS_FILE), metadata.dtype, shape, metadata.tokens_sha256)


def global_sequence_ids(indices: np.ndarray | range | Sequence[int], num_sequences: int, seed: int, *,
                        owner: str) -> np.ndarray:
    """The stored sequence each global sample index reads: epoch i // n visits a permutation of all n."""
    require_int(f"{owner}.batch", "seed", seed, minimum=0)
    values = np.asarray(indices)
    if values.size == 0:
        return np.empty(0, dtype=np.int64)
    if values.ndim != 1 or not np.issubdtype(values.dtype, np.integer) or values.min() < 0:
        raise ValueError(f"{owner}.batch.indices={indices!r} is invalid: expected a 1-D list of integers >= 0")
    epochs, positions = np.divmod(values.astype(np.int64), num_sequences)
    ids = np.empty_like(positions)
    for epoch in np.unique(epochs):
        selected = epochs == epoch
        ids[selected] = _permutation(num_sequences, seed, int(epoch))[positions[selected]]
    return ids


# Module-level caches rather than fields: they stay in the process that filled them and are never pickled.
@functools.lru_cache(maxsize=8)
def _map_tokens(path: str, dtype: str, shape: tuple[int, int], sha256: str) -> np.memmap:
    return np.memmap(path, dtype=dtype, mode="r", shape=shape)


@functools.lru_cache(maxsize=2)
def _permutation(num_sequences: int, seed: int, epoch: int) -> np.ndarray:
    order = np.random.Generator(np.random.PCG64(seed * 1_000_003 + epoch)).permutation(num_sequences)
    order.flags.writeable = False
    return order


def expand_files(files: Sequence[str | Path] | str | Path) -> list[Path]:
    """Absolute paths of the files named or matched: each pattern's matches sorted, the list's order kept."""
    entries = [files] if isinstance(files, (str, Path)) else list(files)
    if not entries:
        raise ValueError("TokenDataset.build.files=[] is invalid: expected at least one file or glob pattern")
    paths: list[Path] = []
    for entry in entries:
        for path in _expand_entry(str(entry)):
            if path not in paths:
                paths.append(path)
    return paths


def _expand_entry(entry: str) -> list[Path]:
    if _GLOB_CHARACTERS & set(entry) and not Path(entry).exists():
        matches = sorted(Path(match).resolve() for match in glob.glob(entry, recursive=True) if Path(match).is_file())
        if not matches:
            raise ValueError(f"TokenDataset.build.files: the pattern {entry!r} matches no file")
    else:
        path = Path(entry)
        if not path.exists():
            raise ValueError(f"TokenDataset.build.files: {entry!r} does not exist")
        if not path.is_file():
            raise ValueError(f"TokenDataset.build.files: {entry!r} is a directory: name its files, e.g. {entry}/*.txt")
        matches = [path.resolve()]
    for path in matches:
        if path.suffix.lower() not in SUPPORTED_EXTENSIONS:
            raise ValueError(
                f"TokenDataset.build.files: {str(path)!r} has an unsupported extension {path.suffix!r}: "
                f"expected one of {', '.join(SUPPORTED_EXTENSIONS)}"
            )
    return matches


def resolve_tokenizer(tokenizer: str | Path | PreTrainedTokenizerBase) -> tuple[PreTrainedTokenizerBase, str]:
    if isinstance(tokenizer, (str, Path)):
        name = str(Path(tokenizer).resolve())
        tokenizer = load_tokenizer(tokenizer)
    else:
        from transformers import PreTrainedTokenizerBase

        if not isinstance(tokenizer, PreTrainedTokenizerBase):
            raise ValueError(
                f"TokenDataset.build.tokenizer={tokenizer!r} is invalid: expected a tokenizer directory "
                "or a transformers tokenizer"
            )
        name = str(getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__)
    if tokenizer.eos_token_id is None:
        raise ValueError(
            f"the tokenizer {name!r} has no eos token: packing puts eos after every document; set tokenizer.eos_token"
        )
    return tokenizer, name


def _read_metadata(directory: Path) -> TokenDatasetMetadata:
    path = directory / METADATA_FILE
    if not path.is_file():
        raise ValueError(
            f"{directory} holds no {METADATA_FILE}: it is not a dataset directory, or its build never finished; "
            "build it with TokenDataset.build"
        )
    try:
        return TokenDatasetMetadata.from_json(json.loads(path.read_text()))
    except (ValueError, TypeError, KeyError) as error:
        raise ValueError(
            f"{path} is not valid dataset metadata ({error}); rebuild the dataset with TokenDataset.build(..., "
            "overwrite=True)"
        ) from error


def _build_directory(
    directory: Path,
    paths: list[Path],
    sources: tuple[SourceFile, ...],
    tokenizer: PreTrainedTokenizerBase,
    tokenizer_name: str,
    seq_len: int,
    text_field: str,
) -> TokenDatasetMetadata:
    """Write tokens.bin then dataset.json; datasets' cache and every partial file stay in a scratch folder."""
    vocab_size = len(tokenizer)
    dtype = "uint16" if vocab_size <= 1 << 16 else "uint32"
    directory.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=".build-", dir=directory))
    try:
        staged = scratch / TOKENS_FILE
        with staged.open("wb") as handle:
            cache_dir = scratch / "hf_cache"
            num_written, num_documents = _write_tokens(paths, tokenizer, text_field, cache_dir, handle, dtype)
            num_sequences = _check_enough_tokens(num_written, num_documents, seq_len)
            num_tokens = num_sequences * (seq_len + 1)
            handle.truncate(num_tokens * np.dtype(dtype).itemsize)
        metadata = TokenDatasetMetadata(
            format_version=FORMAT_VERSION,
            seq_len=seq_len,
            num_sequences=num_sequences,
            num_tokens=num_tokens,
            num_documents=num_documents,
            num_dropped_tokens=num_written - num_tokens,
            dtype=dtype,
            vocab_size=vocab_size,
            eos_token_id=int(tokenizer.eos_token_id),
            tokenizer=tokenizer_name,
            tokenizer_fingerprint=tokenizer_fingerprint(tokenizer),
            text_field=text_field,
            sources=sources,
            tokens_sha256=sha256_file(staged),
        )
        _publish(directory, staged, metadata)
        return metadata
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _publish(directory: Path, staged: Path, metadata: TokenDatasetMetadata) -> None:
    # dataset.json goes first and comes back last, so no crash leaves it describing other tokens.
    (directory / METADATA_FILE).unlink(missing_ok=True)
    fsync_path(staged)
    staged.replace(directory / TOKENS_FILE)
    write_json_atomically(directory / METADATA_FILE, metadata.to_json())
    fsync_path(directory)


def _check_enough_tokens(num_written: int, num_documents: int, seq_len: int) -> int:
    if num_written == 0:
        raise ValueError("TokenDataset.build.files yield no tokens: every document is empty")
    if num_written < seq_len + 1:
        raise ValueError(
            f"TokenDataset.build.files yield {num_written} tokens ({num_documents} documents, eos included), "
            f"but one sequence of seq_len={seq_len} needs {seq_len + 1}: add text or lower seq_len"
        )
    return num_written // (seq_len + 1)


def _write_tokens(
    paths: list[Path],
    tokenizer: PreTrainedTokenizerBase,
    text_field: str,
    cache_dir: Path,
    handle: BinaryIO,
    dtype: str,
) -> tuple[int, int]:
    """Append every document's ids and eos to `handle` in file and row order; return (tokens, documents).
    A build that takes more than two seconds shows its progress on stderr (bytes read, tokens written)."""
    num_written = num_documents = 0
    with tqdm(total=sum(path.stat().st_size for path in paths), unit="B", unit_scale=True, desc="tokenize",
              file=sys.stderr, delay=2.0) as progress:
        for path in paths:
            for ids, count in tokenize_file(path, tokenizer, text_field=text_field, cache_dir=cache_dir):
                handle.write(ids.astype(dtype).tobytes())
                num_written += ids.size
                num_documents += count
            progress.update(path.stat().st_size)
            progress.set_postfix(tokens=f"{num_written:,}", refresh=False)
            logger.info("tokenized %s: %d tokens so far", path, num_written)
    return num_written, num_documents
