"""Keep Ray's, Serve's and the libraries' log lines out of the terminal, in a file of the run.

Ray's core writes to file descriptor 2 from C++, Serve and transformers through Python logging and
warnings, and processes Ray starts (raylet, GCS, workers) inherit descriptor 2: only a redirection of
the descriptor itself catches them all. The caller's own output goes to stdout, which stays on the
terminal.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def stderr_to_file(path: str | Path, *, enabled: bool = True) -> Iterator[Path | None]:
    """Within the block, everything written to stderr by this process and the processes it starts goes
    to `path` (appended). Yields the path, or None when `enabled` is False and nothing is redirected.
    Restored on exit, so an exception's traceback still reaches the terminal."""
    if not enabled:
        yield None
        return
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    sys.stderr.flush()
    terminal = os.dup(2)
    with path.open("ab") as log:
        os.dup2(log.fileno(), 2)
    try:
        yield path
    finally:
        sys.stderr.flush()
        os.dup2(terminal, 2)
        os.close(terminal)
