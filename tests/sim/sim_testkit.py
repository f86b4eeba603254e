"""Helpers of the simulated-engine tests."""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import signal
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from llmgw_sim import answers

_SAMPLE_RE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})? (\S+)$")


def said(prompt: str, n: int, salt: str = "") -> str:
    """The simulator's first ``n`` words of answer to a prompt of these words (system, user and
    earlier turns' words in order), as a new message's text."""
    return " ".join(answers.answer_words(prompt.split(), salt, 0, n))


def prompt_answered_with(start: str) -> str:
    """A one-word prompt whose answer is the sentence of the answers' text that begins with ``start``."""
    words = answers.TEXT.split()
    n = len(start.split())
    at = next(i for i in range(len(words)) if " ".join(words[i : i + n]) == start)
    return next(p for p in (f"w{i}" for i in range(10_000)) if answers.start_of([p], 1) == at)


def parse_metrics(text: str) -> dict[str, tuple[str, float]]:
    """Metric name → (label text, value) for each sample line of a Prometheus exposition."""
    out: dict[str, tuple[str, float]] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = _SAMPLE_RE.match(line)
        assert m, f"not a Prometheus sample line: {line!r}"
        out[m.group(1)] = (m.group(2) or "", float(m.group(3)))
    return out


@dataclass
class EngineProcess:
    proc: asyncio.subprocess.Process
    url: str
    log: Path

    async def stop(self, sig: int = signal.SIGTERM, timeout: float = 5.0) -> int:
        """terminate → wait → kill; returns the exit code."""
        if self.proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.send_signal(sig)
            try:
                await asyncio.wait_for(self.proc.wait(), timeout)
            except TimeoutError:
                self.proc.kill()
                await self.proc.wait()
        assert self.proc.returncode is not None
        return self.proc.returncode


@dataclass(frozen=True)
class SseEvent:
    """One server-sent event: its ``event:`` name (None without one) and its ``data:`` text."""

    event: str | None
    data: str

    def json(self) -> Any:
        return json.loads(self.data)


def parse_sse(raw: bytes) -> list[SseEvent]:
    """The events of a whole SSE body; a block without data (a comment) is skipped."""
    out: list[SseEvent] = []
    for block in raw.decode().split("\n\n"):
        if not block.strip():
            continue
        name: str | None = None
        data: list[str] = []
        for line in block.split("\n"):
            if line.startswith("event:"):
                name = line[6:].strip()
            elif line.startswith("data:"):
                data.append(line[5:].removeprefix(" "))
        if data:
            out.append(SseEvent(name, "\n".join(data)))
    return out
