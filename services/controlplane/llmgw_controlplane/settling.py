"""When the control plane may judge nodes and act, once reports had time to arrive: the loop and the lease read it."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class Settling:
    """When the loop may judge and act: never while this process is cut off from NATS (heartbeats
    cannot arrive, so no node's silence may be judged), and only once reports had ``settle_s`` to arrive
    after it began listening (or came back)."""

    settle_s: float
    # When this process began listening (own clock).
    started_at: float
    until: float = 0.0
    # False while this process is cut off from NATS (ARCHITECTURE: a lost command or reconnect must
    # not leave nodes wrong).
    bus_up: bool = True

    def listening_from(self, t: float) -> None:
        self.started_at = t
        self.until = t + self.settle_s

    def from_start(self) -> None:
        """A takeover: reports are awaited from when this process began listening, so a standby that
        has listened that long already acts at once."""
        self.until = self.started_at + self.settle_s

    def bus_back(self, now: float) -> None:
        self.until = max(self.until, now + self.settle_s)
        self.bus_up = True
