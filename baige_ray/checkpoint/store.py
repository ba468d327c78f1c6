"""Persisted checkpoints of canonical state: one directory per step, checksummed, committed atomically.

    root/step-00000120/
        model.safetensors       {name: full tensor}
        optimizer.safetensors   {"<name>/<key>": tensor}, e.g. "blocks.0.up.weight/exp_avg"
        meta.json               step, write time and the caller's meta (layout, model config, ...)

or, written by every rank of a sharded engine in parallel (sharded.py), the pieces it keeps:
        rank-00000.safetensors  {"model/<name>": piece, "optimizer/<name>/<key>": piece}
        rank-00000.json         where each piece sits in its full tensor
        ...
        manifest.json           size and SHA-256 of each file above
        COMMITTED               the manifest's SHA-256, written last

Files are written into a hidden sibling directory and fsynced; the directory is
renamed into place and only then is COMMITTED written. A directory without a
valid COMMITTED marker was never finished and is never loaded. Canonical state
is layout-independent, so a checkpoint loads into any parallel layout.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import torch

from baige_ray.api.errors import CheckpointError
from baige_ray.checkpoint.files import file_record, fsync_path, sha256_file, write_json_atomically
from baige_ray.checkpoint.sharded import read_rank_part, sharded_files
from baige_ray.checkpoint.tensor_file import read_tensor_file, write_tensor_file
from baige_ray.parallel.shards import assemble
from baige_ray.parallel.state import CanonicalState

logger = logging.getLogger(__name__)

FORMAT_VERSION = 1
MODEL_FILE = "model.safetensors"
OPTIMIZER_FILE = "optimizer.safetensors"
META_FILE = "meta.json"
MANIFEST_FILE = "manifest.json"
COMMIT_MARKER = "COMMITTED"
DATA_FILES = (MODEL_FILE, OPTIMIZER_FILE, META_FILE)
KEY_SEPARATOR = "/"
_STEP_DIR = re.compile(r"^step-(\d{8,})$")
_LEFTOVER_DIR = re.compile(r"^\.step-(\d{8,})\.(tmp|old)-")


def checkpoint_dir_name(step: int) -> str:
    return f"step-{step:08d}"


def flatten_optimizer(optimizer: dict[str, dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    flat: dict[str, torch.Tensor] = {}
    for name, entries in optimizer.items():
        for key, value in entries.items():
            if KEY_SEPARATOR in key:
                raise ValueError(f"optimizer state key {key!r} of {name!r} contains {KEY_SEPARATOR!r}")
            if not isinstance(value, torch.Tensor):
                raise TypeError(f"optimizer state {name}/{key} is a {type(value).__name__}; only tensors persist")
            flat[f"{name}{KEY_SEPARATOR}{key}"] = value
    return flat


def unflatten_optimizer(flat: dict[str, torch.Tensor]) -> dict[str, dict[str, torch.Tensor]]:
    optimizer: dict[str, dict[str, torch.Tensor]] = {}
    for flat_key, value in flat.items():
        name, key = flat_key.rsplit(KEY_SEPARATOR, 1)
        optimizer.setdefault(name, {})[key] = value
    return optimizer


# ---------------------------------------------------------------- writing


def write_checkpoint(
    root: Path, step: int, state: CanonicalState, *, meta: dict, keep_last: int | None = None
) -> Path:
    """Persist `state` as root/step-{step:08d}/ and commit it; then keep only the newest `keep_last`."""
    staging = begin_checkpoint(root, step)
    try:
        files = {
            MODEL_FILE: write_tensor_file(staging / MODEL_FILE, state["model"]),
            OPTIMIZER_FILE: write_tensor_file(staging / OPTIMIZER_FILE, flatten_optimizer(state["optimizer"])),
        }
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return commit_checkpoint(root, staging, step, files, meta=meta, keep_last=keep_last)


def begin_checkpoint(root: Path, step: int) -> Path:
    """A fresh hidden staging directory under `root` for the files of step `step`'s checkpoint."""
    if step < 0:
        raise ValueError(f"step={step} is invalid: expected >= 0")
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    staging = root / f".{checkpoint_dir_name(step)}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    staging.mkdir()
    return staging


def commit_checkpoint(
    root: Path, staging: Path, step: int, files: dict[str, dict], *, meta: dict, keep_last: int | None = None,
    ranks: int | None = None,
) -> Path:
    """Add meta and manifest to the data `files` written into `staging` (their records by name), move it
    into place as root/step-{step:08d}/ and commit it. `ranks`: the files are that many ranks' pieces
    (sharded.py), not whole tensors. The staging directory is removed if anything fails."""
    meta_record = {"format_version": FORMAT_VERSION, "step": step, "written_unix_s": time.time(), "meta": meta}
    final = Path(root) / checkpoint_dir_name(step)
    try:
        json.dumps(meta_record)  # refuse unserializable meta before the manifest is written
        write_json_atomically(staging / META_FILE, meta_record)
        manifest = {"format_version": FORMAT_VERSION, "step": step,
                    "files": {**files, META_FILE: file_record(staging / META_FILE)}}
        if ranks is not None:
            manifest["ranks"] = ranks
        write_json_atomically(staging / MANIFEST_FILE, manifest)
        manifest_sha256 = sha256_file(staging / MANIFEST_FILE)
        fsync_path(staging)
        _move_into_place(staging, final)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    write_json_atomically(final / COMMIT_MARKER, {"step": step, "manifest_sha256": manifest_sha256})
    fsync_path(final)
    if keep_last is not None:
        prune_checkpoints(root, keep_last)
    return final


def _move_into_place(staging: Path, final: Path) -> None:
    """Rename `staging` to `final`; an existing `final` (the same step written again) is decommitted first."""
    if final.exists():
        (final / COMMIT_MARKER).unlink(missing_ok=True)
        retired = final.with_name(f".{final.name}.old-{uuid.uuid4().hex[:8]}")
        os.replace(final, retired)
        os.replace(staging, final)
        shutil.rmtree(retired, ignore_errors=True)
    else:
        os.replace(staging, final)
    fsync_path(final.parent)


# ---------------------------------------------------------------- listing and retention


def _step_dirs(root: Path) -> list[tuple[int, Path]]:
    """Every finished-or-not step directory under `root`, oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [(int(match.group(1)), path) for path in root.iterdir()
             if path.is_dir() and (match := _STEP_DIR.match(path.name))]
    return sorted(found)


def list_checkpoints(root: Path) -> list[tuple[int, Path]]:
    """Committed checkpoints, oldest first (committed is not verified: see `verify_checkpoint`)."""
    return [(step, path) for step, path in _step_dirs(root) if (path / COMMIT_MARKER).is_file()]


def prune_checkpoints(root: Path, keep_last: int) -> list[Path]:
    """Delete all but the newest `keep_last` committed checkpoints, and unfinished ones older than the newest."""
    if keep_last < 1:
        raise ValueError(f"keep_last={keep_last} is invalid: expected >= 1")
    committed = list_checkpoints(root)
    if not committed:
        return []
    newest = committed[-1][0]
    doomed = [path for _, path in committed[:-keep_last]]
    doomed += [path for step, path in _step_dirs(root) if step < newest and not (path / COMMIT_MARKER).exists()]
    doomed += [path for path in Path(root).iterdir()
               if (match := _LEFTOVER_DIR.match(path.name)) and int(match.group(1)) < newest]
    for path in doomed:
        (path / COMMIT_MARKER).unlink(missing_ok=True)  # decommit first: a half-deleted directory is never loaded
        shutil.rmtree(path, ignore_errors=True)
    return doomed


# ---------------------------------------------------------------- verifying and loading


def _read_json(path: Path, what: str) -> dict:
    try:
        value = json.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{path} is missing: {what}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise CheckpointError(f"{path} is not valid JSON ({error}): the checkpoint is corrupted") from None
    if not isinstance(value, dict):
        raise CheckpointError(f"{path} holds a {type(value).__name__}, expected a JSON object: corrupted")
    return value


def _check_file(path: Path, expected: dict) -> None:
    if not path.is_file():
        raise CheckpointError(f"{path} is missing")
    size = path.stat().st_size
    if size != expected["bytes"]:
        raise CheckpointError(f"{path} holds {size} bytes, expected {expected['bytes']}: truncated or overwritten")
    actual = sha256_file(path)
    if actual != expected["sha256"]:
        raise CheckpointError(f"{path} fails its SHA-256 check: expected {expected['sha256']}, got {actual}")


def verify_checkpoint(path: Path) -> dict:
    """Check the commit marker, the manifest and every file's size and SHA-256; return the manifest."""
    path = Path(path)
    marker = _read_json(path / COMMIT_MARKER, "the checkpoint was never committed")
    manifest_path = path / MANIFEST_FILE
    if not manifest_path.is_file():
        raise CheckpointError(f"{manifest_path} is missing")
    actual = sha256_file(manifest_path)
    if actual != marker.get("manifest_sha256"):
        raise CheckpointError(
            f"{manifest_path} fails its SHA-256 check: expected {marker.get('manifest_sha256')}, got {actual}"
        )
    manifest = _read_json(manifest_path, "the checkpoint has no manifest")
    if manifest.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(f"{manifest_path} has format_version={manifest.get('format_version')!r}, "
                              f"expected {FORMAT_VERSION}")
    ranks = manifest.get("ranks")
    if ranks is not None and (not isinstance(ranks, int) or ranks < 1):
        raise CheckpointError(f"{manifest_path} has ranks={ranks!r}, expected a positive integer: corrupted")
    expected = DATA_FILES if ranks is None else [*sharded_files(ranks), META_FILE]
    missing = [name for name in expected if name not in manifest.get("files", {})]
    if missing:
        raise CheckpointError(f"{manifest_path} does not list {missing}")
    for name, expected in manifest["files"].items():
        _check_file(path / name, expected)
    return manifest


def load_checkpoint(path: Path) -> tuple[int, CanonicalState, dict]:
    """Verify, then read: (step, canonical state, the meta the writer was given)."""
    path = Path(path)
    manifest = verify_checkpoint(path)
    if "ranks" in manifest:
        state = assemble([read_rank_part(path, rank) for rank in range(manifest["ranks"])])
    else:
        state = {"model": read_tensor_file(path / MODEL_FILE),
                 "optimizer": unflatten_optimizer(read_tensor_file(path / OPTIMIZER_FILE))}
    meta_record = _read_json(path / META_FILE, "the checkpoint has no meta")
    return manifest["step"], state, meta_record["meta"]


def load_latest_good(root: Path, on_skip: Callable[[int, Path, CheckpointError], None] | None = None,
                     ) -> tuple[int, CanonicalState, dict] | None:
    """The newest checkpoint that is committed and verifies; bad ones are skipped with a warning saying why
    (and handed to `on_skip`, for a job's own record of them)."""
    for step, path in reversed(_step_dirs(root)):
        try:
            return load_checkpoint(path)
        except CheckpointError as error:
            logger.warning("skipping checkpoint of step %d at %s: %s", step, path, error)
            if on_skip is not None:
                on_skip(step, path, error)
    return None
