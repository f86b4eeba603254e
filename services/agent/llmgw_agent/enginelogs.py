"""Engine logs: one file per shard under the state directory, and its tail for a failure report."""

from __future__ import annotations

import os
import re
from pathlib import Path

LOG_TAIL_LINES = 50
MAX_LINE = 1000


def read_tail(path: Path, lines: int = LOG_TAIL_LINES, max_bytes: int = 64 * 1024) -> tuple[str, ...]:
    """The last ``lines`` lines of a log file (empty when there is none)."""
    try:
        with path.open("rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - max_bytes))
            data = f.read()
    except OSError:
        return ()
    text = data.decode("utf-8", errors="replace")
    # Long lines are cut so that a status message stays far below NATS' payload limit.
    return tuple(
        line if len(line) <= MAX_LINE else line[:MAX_LINE] + " …" for line in text.splitlines()[-lines:]
    )


def safe_name(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]", "_", name)


def open_log(path: Path) -> int:
    path.parent.mkdir(parents=True, exist_ok=True)
    return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
