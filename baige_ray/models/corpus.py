"""A byte-level text corpus built from this machine's Python standard library.

Real text with no download: the stdlib's own .py files, in sorted path order,
concatenated into one byte array. A training sample is named by its global
index; a counter-based hash of (seed, index) picks its offset, so any rank
layout can read exactly the samples of any step and resume at an exact position.
"""

from __future__ import annotations

import functools
import hashlib
import os
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from baige_ray.api.validation import require_int, require_number

# Test suites and the IDE add bulk but little variety; skipping them keeps the corpus small.
_SKIPPED_DIRS = {"test", "tests", "idlelib", "site-packages", "dist-packages", "__pycache__"}


@dataclass(kw_only=True, frozen=True)
class CorpusConfig:
    max_bytes: int = 8 * 1024 * 1024
    validation_fraction: float = 0.05

    def __post_init__(self) -> None:
        require_int("CorpusConfig", "max_bytes", self.max_bytes, minimum=4096)
        require_number("CorpusConfig", "validation_fraction", self.validation_fraction, minimum=0, maximum=0.5)


def stdlib_source_files(root: Path | None = None) -> list[Path]:
    """The stdlib's .py files in sorted path order; skipped folders are never entered."""
    root = Path(root or sysconfig.get_paths()["stdlib"])
    files = []
    for directory, subdirectories, names in os.walk(root):
        subdirectories[:] = [name for name in subdirectories if name not in _SKIPPED_DIRS]
        files.extend(Path(directory, name) for name in names if name.endswith(".py"))
    return sorted(files)


def _read_bytes(files: list[Path], max_bytes: int) -> bytes:
    chunks, total = [], 0
    for path in files:
        data = path.read_bytes()
        chunks.append(data)
        total += len(data)
        if total >= max_bytes:
            break
    return b"".join(chunks)[:max_bytes]


def _splitmix64(values: np.ndarray) -> np.ndarray:
    """A counter-based 64-bit mixer (Steele et al., SplitMix): same input, same output, any order."""
    z = values.astype(np.uint64) + np.uint64(0x9E3779B97F4A7C15)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


class ByteCorpus:
    """Bytes of text with deterministic, index-addressed sampling of fixed-length windows."""

    def __init__(self, data: bytes, *, validation_fraction: float = 0.05):
        self._data = np.frombuffer(data, dtype=np.uint8)
        self._split = int(len(self._data) * (1.0 - validation_fraction))
        self.fingerprint = hashlib.sha256(data).hexdigest()[:16]

    @classmethod
    def from_stdlib(cls, config: CorpusConfig | None = None, root: Path | None = None) -> ByteCorpus:
        config = config or CorpusConfig()
        data = _read_bytes(stdlib_source_files(root), config.max_bytes)
        if len(data) < 4096:
            raise ValueError(f"the standard library under {root} holds only {len(data)} bytes of source")
        return cls(data, validation_fraction=config.validation_fraction)

    def __len__(self) -> int:
        return len(self._data)

    def sample_offsets(self, indices: np.ndarray, seq_len: int, seed: int, split: str = "train") -> np.ndarray:
        start, stop = (0, self._split) if split == "train" else (self._split, len(self._data))
        num_starts = stop - start - seq_len - 1
        if num_starts <= 0:
            raise ValueError(f"corpus split {split!r} holds {stop - start} bytes, too few for seq_len={seq_len}")
        keys = np.asarray(indices, dtype=np.uint64) ^ _splitmix64(np.array([seed], dtype=np.uint64))
        return start + (_splitmix64(keys) % np.uint64(num_starts)).astype(np.int64)

    def batch(
        self, indices: np.ndarray | range, seq_len: int, seed: int, split: str = "train"
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Inputs and next-byte targets (batch, seq_len) for the given global sample indices."""
        require_int("ByteCorpus.batch", "seq_len", seq_len, minimum=1)
        offsets = self.sample_offsets(np.asarray(indices), seq_len, seed, split)
        windows = self._data[offsets[:, None] + np.arange(seq_len + 1)[None, :]]
        tokens = torch.from_numpy(windows.astype(np.int64))
        return tokens[:, :-1], tokens[:, 1:]

    def decode(self, tokens: torch.Tensor | list[int]) -> str:
        values = tokens.tolist() if isinstance(tokens, torch.Tensor) else tokens
        return bytes(values).decode("utf-8", errors="replace")

    def encode(self, text: str) -> torch.Tensor:
        return torch.tensor(list(text.encode("utf-8")), dtype=torch.long)


@functools.lru_cache(maxsize=2)
def stdlib_corpus(config: CorpusConfig | None = None) -> ByteCorpus:
    """The process-wide corpus; workers on one node each build the same bytes once."""
    return ByteCorpus.from_stdlib(config)


class CorpusWindows:
    """The corpus as a sample source of `seq_len`-byte windows (the interface every engine reads)."""

    def __init__(self, corpus: ByteCorpus, seq_len: int):
        self.corpus, self.seq_len = corpus, seq_len
        self.fingerprint = corpus.fingerprint

    def batch(self, indices: np.ndarray | range, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.corpus.batch(indices, self.seq_len, seed)

    def trained_tokens(self, indices: np.ndarray | range, seed: int) -> int:
        return len(indices) * self.seq_len
