"""Durable file primitives every checkpoint writer shares: hashing, fsync, atomic replace."""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO


def sha256_file(path: Path) -> str:
    with Path(path).open("rb") as handle:
        return hashlib.file_digest(handle, "sha256").hexdigest()


def fsync_path(path: Path) -> None:
    """Flush a file's or a directory's metadata to stable storage (a rename is durable only after this)."""
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def write_atomically(path: Path, write: Callable[[BinaryIO], object]) -> None:
    """`write(handle)` into a hidden sibling, fsync it, then rename it over `path`."""
    path = Path(path)
    temporary = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with temporary.open("wb") as handle:
        write(handle)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(temporary, path)


def write_json_atomically(path: Path, value: object) -> None:
    encoded = json.dumps(value, indent=2, sort_keys=True).encode()
    write_atomically(path, lambda handle: handle.write(encoded))


def file_record(path: Path) -> dict[str, object]:
    """What a manifest holds about one file: its size and SHA-256."""
    return {"bytes": Path(path).stat().st_size, "sha256": sha256_file(path)}
