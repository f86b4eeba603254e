"""When `llmgw up` restarts a child that died: a doubling delay per child, capped, that starts over
once the child had served a while (pure, with the clock injected)."""

from __future__ import annotations

import time
from collections.abc import Callable

from llmgw_common.backoff import backoff_delay

RESTART_BASE_S = 1.0
RESTART_MAX_S = 30.0
# A child that ran this long before it died was not crash-looping: its next restart is prompt again.
HEALTHY_AFTER_S = 60.0


class Restarts:
    """Per child (by name): consecutive quick deaths, when its restart is due, and restarts done."""

    def __init__(
        self,
        *,
        base_s: float = RESTART_BASE_S,
        max_s: float = RESTART_MAX_S,
        healthy_after_s: float = HEALTHY_AFTER_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.base_s = base_s
        self.max_s = max_s
        self.healthy_after_s = healthy_after_s
        self.clock = clock
        # Restarts done so far, by child: shown in `up`'s output and its state file.
        self.count: dict[str, int] = {}
        self._failures: dict[str, int] = {}
        self._due: dict[str, float] = {}

    def died(self, name: str, ran_s: float) -> float:
        """Note a death after ``ran_s`` seconds of running; the delay before its restart."""
        quick = ran_s < self.healthy_after_s
        failures = self._failures.get(name, 0) + 1 if quick else 1
        self._failures[name] = failures
        delay = backoff_delay(failures, self.base_s, self.max_s)
        self._due[name] = self.clock() + delay
        return delay

    def pending(self, name: str) -> bool:
        """Dead and noted, not restarted yet."""
        return name in self._due

    def due(self, name: str) -> bool:
        return name in self._due and self.clock() >= self._due[name]

    def restarted(self, name: str) -> int:
        """Note the restart done; the child's restart count."""
        self._due.pop(name, None)
        self.count[name] = self.count.get(name, 0) + 1
        return self.count[name]
