"""Timestamps from the bus, checked against the receiver's own clock.

A sender's clock says what the sender claims, nothing more: a receiver never judges freshness by it
(health is by arrival time), and it uses a sender's time only to order that sender's own messages. Two
rules keep one bad message from doing lasting harm:

- :func:`distrust` refuses a time that is not a finite number or lies further in the future than
  :data:`MAX_AHEAD_S` by the receiver's clock (a forged ``1e300``, ``inf``, ``nan``). Times in the past
  are allowed: a sender that was cut off from the bus flushes its buffered messages late.
- :func:`order_time` is what a kept message's time counts as when later messages are compared with
  it: never later than when it arrived. A message that claims a time ahead of ours (within the allowed
  skew) then outranks the sender's genuine messages only until one is sent after it arrived, not for as
  long as its claim.

:class:`Doubts` says why a message was refused in one log line, at most once per sender and reason per
interval, and counts every refusal.
"""

from __future__ import annotations

import logging
import math

# How far ahead of the receiver's clock a sender's clock may run. Clocks of a cluster are kept by NTP
# to well under a second; five minutes leave room for a node whose sync is off without accepting years.
# Generous on purpose: :func:`order_time` already keeps a time ahead of ours from outranking later
# messages, so this bound only decides when a sender is refused outright (its node then goes lost).
MAX_AHEAD_S = 300.0
# A refused sender is named in the log at most this often (per sender and kind of reason).
DOUBT_LOG_EVERY_S = 60.0


def distrust(t: float, now: float, what: str = "sent_at", max_ahead_s: float = MAX_AHEAD_S) -> str | None:
    """Why the sender's time ``t`` cannot be believed at ``now`` (our clock), or None when it can."""
    if not math.isfinite(t):
        return f"{what} {t!r} is not a finite time"
    if t > now + max_ahead_s:
        return f"{what} is {t - now:.3g}s ahead of our clock (at most {max_ahead_s:g}s allowed)"
    return None


def distrust_all(
    times: dict[str, float], now: float, what: str, max_ahead_s: float = MAX_AHEAD_S
) -> str | None:
    """The first of ``times`` (name -> time) that cannot be believed, said as :func:`distrust` says it."""
    for name, t in times.items():
        why = distrust(t, now, f"{what} {name!r}", max_ahead_s)
        if why is not None:
            return why
    return None


def order_time(sent_at: float, received_at: float) -> float:
    """The time a kept message counts as when the same sender's later messages are compared with it."""
    return min(sent_at, received_at)


class Doubts:
    """One log line per refused message's sender and reason per ``every_s`` (our clock); all counted."""

    def __init__(self, logger: logging.Logger, every_s: float = DOUBT_LOG_EVERY_S) -> None:
        self.logger = logger
        self.every_s = every_s
        self.count = 0
        self._said: dict[tuple[str, str], float] = {}

    def refuse(self, sender: str, kind: str, why: str, now: float) -> None:
        """``sender`` (e.g. ``node n1``) sent a message that is not believed: ``kind`` groups the reasons."""
        self.count += 1
        key = (sender, kind)
        last = self._said.get(key)
        if last is not None and now - last < self.every_s:
            return
        if len(self._said) > 4096:
            # Bounded: a flood of invented senders must not grow this without end.
            self._said.clear()
        self._said[key] = now
        self.logger.warning("not believed from %s (%s): %s", sender, kind, why)
