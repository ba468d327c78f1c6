"""Conversations for supervised fine-tuning, built from local files through the model's tokenizer and chat template.

Each row of a .jsonl, .json or .parquet file (read with Hugging Face `datasets`) is one conversation
(`messages`) or one prompt and completion; chat_rendering.py renders it and marks the tokens the loss
trains. Conversations are packed into stored sequences of seq_len + 1 tokens by best-fit decreasing
(packing.py), each sequence right-padded, with every token's position in its own conversation: the
model attends within each conversation only, positions starting at 0 in each (packing="none": one
conversation a sequence). Padding and untrained tokens are targets of
IGNORE_INDEX, and the loss of a step is the mean over its trained tokens (Engine.loss), however
unevenly the micro-batches and replicas hold them.

Like TokenDataset: one memory-mapped file any rank reads by global sample index, a permutation drawn
from (seed, epoch) per epoch, a directory reused while its sources, tokenizer and settings are the same,
SHA-256 checksums verified on opening.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import logging
import shutil
import sys
import tempfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch
from tqdm.auto import tqdm

from baige_ray.api.validation import require_choice, require_int
from baige_ray.checkpoint.files import fsync_path, sha256_file, write_json_atomically
from baige_ray.models.chat_rendering import TRAIN_ON, RenderedConversation, chat_template_of, render_conversation
from baige_ray.models.packing import best_fit_decreasing, restarting_positions
from baige_ray.models.plugin import IGNORE_INDEX
from baige_ray.models.token_dataset import SourceFile, expand_files, global_sequence_ids, resolve_tokenizer
from baige_ray.models.tokenizer import tokenizer_fingerprint

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

FORMAT_VERSION = 1
TOKENS_FILE = "tokens.bin"
TRAINED_FILE = "trained.bin"  # uint8 per token: 1 where the loss trains it
POSITIONS_FILE = "positions.bin"  # int32 per token: its position in its conversation (packed sequences only)
POSITIONS_DTYPE = "int32"
METADATA_FILE = "conversations.json"
TOO_LONG = ("truncate", "refuse")
PACKING = ("bfd", "none")
ROW_FORMATS = (".jsonl", ".json", ".parquet")


@dataclass(kw_only=True, frozen=True)
class ConversationSettings:
    """What a build is asked for besides its files: a directory built otherwise is not reused."""

    seq_len: int
    train_on: str = "assistant"
    too_long: str = "truncate"
    packing: str = "bfd"
    chat_template_sha256: str = ""  # "" where no template renders (prompt/completion text)

    def __post_init__(self) -> None:
        owner = "ConversationDataset.build"
        require_int(owner, "seq_len", self.seq_len, minimum=1)
        require_choice(owner, "train_on", self.train_on, TRAIN_ON)
        require_choice(owner, "too_long", self.too_long, TOO_LONG)
        require_choice(owner, "packing", self.packing, PACKING)

    @property
    def packs_documents(self) -> bool:
        return self.packing != "none"

    def differences(self, other: ConversationSettings) -> list[str]:
        return [f"{field.name} {getattr(self, field.name)!r} != {getattr(other, field.name)!r}"
                for field in dataclasses.fields(self) if getattr(self, field.name) != getattr(other, field.name)]


@dataclass(kw_only=True, frozen=True)
class ConversationDatasetMetadata:
    """The contents of conversations.json."""

    format_version: int
    settings: ConversationSettings
    num_sequences: int
    num_conversations: int
    num_truncated: int  # cut to seq_len + 1 tokens (too_long="truncate")
    num_dropped: int  # truncated so far that no trained token was left
    num_trained_tokens: int
    num_padding_tokens: int
    dtype: str
    vocab_size: int
    pad_token_id: int
    tokenizer: str
    tokenizer_fingerprint: str
    sources: tuple[SourceFile, ...] = dataclasses.field(repr=False)
    tokens_sha256: str
    trained_sha256: str
    positions_sha256: str = ""  # "" without packing

    def __post_init__(self) -> None:
        owner = "ConversationDatasetMetadata"
        require_choice(owner, "format_version", self.format_version, (FORMAT_VERSION,))
        require_int(owner, "num_sequences", self.num_sequences, minimum=1)
        require_choice(owner, "dtype", self.dtype, ("uint16", "uint32"))

    @property
    def seq_len(self) -> int:
        return self.settings.seq_len

    @classmethod
    def from_json(cls, data: dict) -> ConversationDatasetMetadata:
        return cls(**{**data, "settings": ConversationSettings(**data["settings"]),
                      "sources": tuple(SourceFile.from_json(source) for source in data["sources"])})

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


@dataclass(kw_only=True, frozen=True)
class ConversationDataset:
    """A finished directory of rendered conversations: small and picklable; a process maps its files on first read."""

    directory: Path
    metadata: ConversationDatasetMetadata

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
    def fingerprint(self) -> str:
        metadata = self.metadata
        checksums = metadata.tokens_sha256 + metadata.trained_sha256 + metadata.positions_sha256
        return hashlib.sha256(checksums.encode()).hexdigest()[:16]

    @property
    def packs_documents(self) -> bool:
        """Whether a sequence holds several conversations (then `positions` restarts at each)."""
        return self.metadata.settings.packs_documents

    @property
    def padding_fraction(self) -> float:
        return self.metadata.num_padding_tokens / (self.num_sequences * (self.seq_len + 1))

    def __len__(self) -> int:
        return self.num_sequences

    @classmethod
    def build(cls, files: Sequence[str | Path] | str | Path, *, tokenizer: str | Path | PreTrainedTokenizerBase,
              seq_len: int, directory: str | Path, train_on: str = "assistant", chat_template: str | None = None,
              too_long: str = "truncate", packing: str = "bfd", overwrite: bool = False) -> ConversationDataset:
        """Render `files`' conversations into `directory`, or reuse what was built there from them.

        `train_on`: "assistant" (every reply), "completion" (the last reply) or "all" (every token).
        `chat_template`: a Jinja template used instead of the tokenizer's own. `too_long`: a conversation
        of more than seq_len + 1 tokens is cut to its first seq_len + 1 ("truncate") or refused ("refuse").
        `packing`: "bfd" packs several conversations into a sequence by best-fit decreasing (none attends
        to another; each one's positions start at 0), "none" gives each a padded sequence of its own."""
        paths = _conversation_files(files)
        tokenizer, tokenizer_name = resolve_tokenizer(tokenizer)
        template = _template_or_none(tokenizer, chat_template)
        settings = ConversationSettings(seq_len=seq_len, train_on=train_on, too_long=too_long, packing=packing,
                                        chat_template_sha256=hashlib.sha256(template.encode()).hexdigest()
                                        if template else "")
        sources = tuple(SourceFile.of(path) for path in paths)
        directory = Path(directory)
        if (directory / METADATA_FILE).exists() and not overwrite:
            reused = cls._reuse(directory, sources, tokenizer_fingerprint(tokenizer), settings)
            if reused is not None:
                return reused
        builder = _Builder(tokenizer, settings, template)
        metadata = builder.build(directory, paths, sources, tokenizer_name)
        return cls(directory=directory.resolve(), metadata=metadata)

    @classmethod
    def _reuse(cls, directory: Path, sources: tuple[SourceFile, ...], fingerprint: str,
               settings: ConversationSettings) -> ConversationDataset | None:
        metadata = _read_metadata(directory)
        differences = metadata.settings.differences(settings)
        if fingerprint != metadata.tokenizer_fingerprint:
            differences.append(f"tokenizer fingerprint {metadata.tokenizer_fingerprint} != {fingerprint}")
        if differences:
            raise ValueError(f"{directory} already holds conversations built differently ({'; '.join(differences)}); "
                             "pass overwrite=True to replace them, or choose another directory")
        if [s.path for s in sources] != [s.path for s in metadata.sources] or sources != metadata.sources:
            logger.warning("rebuilding the conversations in %s: their source files changed", directory)
            return None
        try:
            return cls.open(directory, verify=True)
        except ValueError as error:
            logger.warning("rebuilding the conversations in %s: %s", directory, error)
            return None

    @classmethod
    def open(cls, directory: str | Path, *, verify: bool = True) -> ConversationDataset:
        """A finished dataset; `verify` re-hashes its files to catch silent corruption."""
        directory = Path(directory)
        if not directory.is_dir():
            raise ValueError(f"dataset directory {str(directory)!r} does not exist")
        metadata = _read_metadata(directory)
        expected_sizes = {TOKENS_FILE: np.dtype(metadata.dtype).itemsize, TRAINED_FILE: 1}
        checksums = {TOKENS_FILE: metadata.tokens_sha256, TRAINED_FILE: metadata.trained_sha256}
        if metadata.settings.packs_documents:
            expected_sizes[POSITIONS_FILE] = np.dtype(POSITIONS_DTYPE).itemsize
            checksums[POSITIONS_FILE] = metadata.positions_sha256
        for name, itemsize in expected_sizes.items():
            path = directory / name
            expected = metadata.num_sequences * (metadata.seq_len + 1) * itemsize
            if not path.is_file() or path.stat().st_size != expected:
                raise ValueError(f"{path} is missing or not {expected} bytes long: the dataset is incomplete or "
                                 "corrupted; rebuild it with ConversationDataset.build")
            if verify and sha256_file(path) != checksums[name]:
                raise ValueError(f"{path} fails its SHA-256 check: the dataset is corrupted; rebuild it with "
                                 "ConversationDataset.build")
        return cls(directory=directory.resolve(), metadata=metadata)

    def sequence_ids(self, indices: np.ndarray | range | Sequence[int], seed: int) -> np.ndarray:
        return global_sequence_ids(indices, self.num_sequences, seed, owner="ConversationDataset")

    def batch(self, indices: np.ndarray | range | Sequence[int], seed: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Inputs (len(indices), seq_len) and next-token targets, IGNORE_INDEX where a token is not trained."""
        ids = self.sequence_ids(indices, seed)
        tokens = torch.from_numpy(self.stored(TOKENS_FILE)[ids].astype(np.int64))
        trained = torch.from_numpy(self.stored(TRAINED_FILE)[ids][:, 1:].astype(bool))
        targets = torch.where(trained, tokens[:, 1:], IGNORE_INDEX)
        return tokens[:, :-1], targets

    def positions(self, indices: np.ndarray | range | Sequence[int], seed: int) -> torch.Tensor | None:
        """Each input token's position in its conversation (int64, like the inputs), restarting at 0 where
        a packed sequence starts the next; None without packing (every sequence is one, from 0)."""
        if not self.packs_documents:
            return None
        rows = self.stored(POSITIONS_FILE)[self.sequence_ids(indices, seed)]
        return torch.from_numpy(rows[:, :-1].astype(np.int64))

    def trained_tokens(self, indices: np.ndarray | range | Sequence[int], seed: int) -> int:
        """The tokens samples `indices` train (the first token of a sequence is never a target)."""
        return int(self.stored(TRAINED_FILE)[self.sequence_ids(indices, seed)][:, 1:].sum(dtype=np.int64))

    def stored(self, name: str) -> np.memmap:
        """A stored file as (sequences, seq_len + 1): TOKENS_FILE, TRAINED_FILE (1 where a token is trained) or,
        packed, POSITIONS_FILE (each token's position in its conversation)."""
        metadata = self.metadata
        dtype = {TOKENS_FILE: metadata.dtype, TRAINED_FILE: "uint8", POSITIONS_FILE: POSITIONS_DTYPE}[name]
        return _map(str(self.directory / name), dtype, (metadata.num_sequences, metadata.seq_len + 1),
                    metadata.tokens_sha256)


@functools.lru_cache(maxsize=8)
def _map(path: str, dtype: str, shape: tuple[int, int], sha256: str) -> np.memmap:
    return np.memmap(path, dtype=dtype, mode="r", shape=shape)


def _conversation_files(files: Sequence[str | Path] | str | Path) -> list[Path]:
    paths = expand_files(files)
    for path in paths:
        if path.suffix.lower() not in ROW_FORMATS:
            raise ValueError(f"ConversationDataset.build.files: {str(path)!r} is not a file of rows: expected "
                             f"one of {', '.join(ROW_FORMATS)} (plain text trains with TokenDataset)")
    return paths


def _template_or_none(tokenizer: PreTrainedTokenizerBase, chat_template: str | None) -> str | None:
    """The template conversations render with, None where the tokenizer has none and none is passed (rows
    of plain-text prompt and completion need none; a conversation then fails naming chat_template=)."""
    try:
        return chat_template_of(tokenizer, chat_template)
    except ValueError:
        return None


def _read_metadata(directory: Path) -> ConversationDatasetMetadata:
    path = directory / METADATA_FILE
    if not path.is_file():
        raise ValueError(f"{directory} holds no {METADATA_FILE}: it is not a conversation dataset, or its build "
                         "never finished; build it with ConversationDataset.build")
    try:
        return ConversationDatasetMetadata.from_json(json.loads(path.read_text()))
    except (ValueError, TypeError, KeyError) as error:
        raise ValueError(f"{path} is not valid dataset metadata ({error}); rebuild the dataset with "
                         "ConversationDataset.build(..., overwrite=True)") from error


class _Builder:
    """Renders every row, then packs the conversations into sequences (best-fit decreasing, or one each),
    counting what it truncated, dropped and padded. The rendered conversations are held in memory until
    they are packed (about 5 bytes a token)."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, settings: ConversationSettings, template: str | None):
        self.tokenizer, self.settings, self.template = tokenizer, settings, template
        self.dtype = "uint16" if len(tokenizer) <= 1 << 16 else "uint32"
        pad = tokenizer.pad_token_id
        self.pad_id = int(pad if pad is not None else tokenizer.eos_token_id)
        self.counts = {"num_sequences": 0, "num_conversations": 0, "num_truncated": 0, "num_dropped": 0,
                       "num_trained_tokens": 0, "num_padding_tokens": 0}

    def build(self, directory: Path, paths: list[Path], sources: tuple[SourceFile, ...],
              tokenizer_name: str) -> ConversationDatasetMetadata:
        directory.mkdir(parents=True, exist_ok=True)
        scratch = Path(tempfile.mkdtemp(prefix=".build-", dir=directory))
        try:
            conversations = self._render_files(paths, scratch / "hf_cache")
            if not conversations:
                raise ValueError("ConversationDataset.build.files hold no conversation with a trained token")
            staged = self._write_sequences(conversations, scratch)
            checksums = {name: sha256_file(path) for name, path in staged.items()}
            metadata = ConversationDatasetMetadata(
                format_version=FORMAT_VERSION, settings=self.settings, **self.counts, dtype=self.dtype,
                vocab_size=len(self.tokenizer), pad_token_id=self.pad_id, tokenizer=tokenizer_name,
                tokenizer_fingerprint=tokenizer_fingerprint(self.tokenizer), sources=sources,
                tokens_sha256=checksums[TOKENS_FILE], trained_sha256=checksums[TRAINED_FILE],
                positions_sha256=checksums.get(POSITIONS_FILE, ""))
            _publish(directory, staged, metadata)
            return metadata
        finally:
            shutil.rmtree(scratch, ignore_errors=True)

    def _render_files(self, paths: list[Path], cache_dir: Path) -> list[RenderedConversation]:
        conversations = []
        with tqdm(total=sum(p.stat().st_size for p in paths), unit="B", unit_scale=True, desc="render",
                  file=sys.stderr, delay=2.0) as progress:
            for path in paths:
                for number, row in enumerate(_rows(path, cache_dir)):
                    conversation = self._render(row, path, number)
                    if conversation is not None:
                        conversations.append(conversation)
                progress.update(path.stat().st_size)
        return conversations

    def _write_sequences(self, conversations: list[RenderedConversation], scratch: Path) -> dict[str, Path]:
        capacity = self.settings.seq_len + 1
        if self.settings.packing == "bfd":
            groups = best_fit_decreasing([len(c.ids) for c in conversations], capacity)
        else:
            groups = [[index] for index in range(len(conversations))]
        names = (TOKENS_FILE, TRAINED_FILE, POSITIONS_FILE) if self.settings.packs_documents else (TOKENS_FILE,
                                                                                                  TRAINED_FILE)
        staged = {name: scratch / name for name in names}
        handles = {name: path.open("wb") for name, path in staged.items()}
        try:
            for group in groups:
                self._write_sequence([conversations[index] for index in group], capacity, handles)
        finally:
            for handle in handles.values():
                handle.close()
        return staged

    def _write_sequence(self, members: list[RenderedConversation], capacity: int, handles: dict) -> None:
        """One sequence: its conversations in order, then padding (a document of its own: never trained)."""
        lengths = [len(member.ids) for member in members]
        padding = capacity - sum(lengths)
        ids = [token for member in members for token in member.ids] + [self.pad_id] * padding
        # A document's first token is never a target: nothing of its own comes before it.
        trained = [flag and at > 0 for member in members for at, flag in enumerate(member.trained)] + [False] * padding
        handles[TOKENS_FILE].write(np.asarray(ids, dtype=self.dtype).tobytes())
        handles[TRAINED_FILE].write(np.asarray(trained, dtype=np.uint8).tobytes())
        if POSITIONS_FILE in handles:
            positions = restarting_positions(lengths + ([padding] if padding else []))
            handles[POSITIONS_FILE].write(positions.astype(POSITIONS_DTYPE).tobytes())
        self.counts["num_sequences"] += 1
        self.counts["num_trained_tokens"] += sum(trained)
        self.counts["num_padding_tokens"] += padding

    def _render(self, row: dict, path: Path, number: int) -> RenderedConversation | None:
        try:
            conversation = render_conversation(row, self.tokenizer, chat_template=self.template,
                                               train_on=self.settings.train_on)
        except ValueError as error:
            raise ValueError(f"{path}, row {number}: {error}") from error
        self.counts["num_conversations"] += 1
        limit = self.settings.seq_len + 1
        truncated = len(conversation.ids) > limit
        if truncated:
            if self.settings.too_long == "refuse":
                raise ValueError(f"{path}, row {number}: the conversation has {len(conversation.ids)} tokens, more "
                                 f"than seq_len + 1 = {limit}; raise seq_len, or pass too_long='truncate'")
            self.counts["num_truncated"] += 1
            conversation = RenderedConversation(ids=conversation.ids[:limit], trained=conversation.trained[:limit])
        if any(conversation.trained[1:]):
            return conversation
        if truncated:  # its replies lay past the cut
            self.counts["num_dropped"] += 1
            logger.warning("%s, row %d: dropped, no trained token within seq_len + 1 = %d tokens", path, number, limit)
            return None
        raise ValueError(f"{path}, row {number}: no token of the conversation is trained with train_on="
                         f"{self.settings.train_on!r}")


def _rows(path: Path, cache_dir: Path) -> Iterator[dict]:
    from baige_ray.models.tokenizer import _quiet_datasets, load_rows

    if path.stat().st_size == 0:
        return
    with _quiet_datasets():
        rows = load_rows(path, cache_dir)
    yield from rows


def _publish(directory: Path, staged: dict[str, Path], metadata: ConversationDatasetMetadata) -> None:
    # The metadata goes first and comes back last, so no crash leaves it describing other files.
    (directory / METADATA_FILE).unlink(missing_ok=True)
    for name, path in staged.items():
        fsync_path(path)
        path.replace(directory / name)
    write_json_atomically(directory / METADATA_FILE, metadata.to_json())
    fsync_path(directory)
