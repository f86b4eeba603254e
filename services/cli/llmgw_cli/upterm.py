"""What `llmgw up` says on the terminal, and the stop flag its signals (Ctrl-C) set."""

from __future__ import annotations

import signal
import sys
import threading
from dataclasses import dataclass, field
from types import FrameType


def out(msg: str = "") -> None:
    print(msg, flush=True)


def err(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


@dataclass
class StopFlag:
    """Set by SIGINT, SIGTERM or SIGHUP; the main loop waits on it instead of sleeping."""

    event: threading.Event
    signum: int | None = None
    # Signals received: a second one while stopping means "now", not "after the grace periods".
    count: int = 0
    saved: dict[int, object] = field(default_factory=dict)

    def handler(self, signum: int, _frame: FrameType | None) -> None:
        self.signum = signum
        self.count += 1
        self.event.set()

    def install(self) -> None:
        for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            self.saved[s] = signal.signal(s, self.handler)

    def restore(self) -> None:
        for s, h in self.saved.items():
            signal.signal(s, h)  # type: ignore[arg-type]
        self.saved.clear()

    def wait(self, seconds: float) -> bool:
        return self.event.wait(seconds)

    def hurry(self) -> bool:
        return self.count >= 2

    @property
    def is_set(self) -> bool:
        return self.event.is_set()
