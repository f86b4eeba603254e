"""Which heartbeat sequence numbers of one agent boot to believe (pure; time comes in as arguments).

An agent numbers its heartbeats 1, 2, 3, ... per boot; the control plane takes a heartbeat's content only
when its ``seq`` is newer than the last one taken, so a heartbeat replayed or reordered after a reconnect
cannot undo a newer one. That makes the newest seq a barrier, and one forged heartbeat with a huge seq
would make every genuine one after it look like a replay. So a seq may run ahead only as far as the time
since the last one allows (missed heartbeats, e.g. while we were cut off, make real jumps); a larger jump
is held and believed only when the next heartbeat follows on from it, which a one-off forgery never does.
"""

from __future__ import annotations

# A seq may run this far ahead of the last one taken, plus two per heartbeat interval since it came.
SEQ_SLACK = 8


def allowed_jump(since_s: float, interval_s: float) -> float:
    """How far a seq may run ahead after ``since_s`` seconds (twice the heartbeats that fit, and some)."""
    return SEQ_SLACK + 2.0 * max(0.0, since_s) / interval_s


def seq_believed(
    last: int, last_at: float, held: tuple[int, float] | None, seq: int, now: float, interval_s: float
) -> bool:
    """Whether ``seq`` (newer than ``last``, taken at ``last_at``) is believed at ``now``.

    ``held`` is the jump held earlier (its seq and when it came): ``seq`` that follows on from it confirms
    it. The caller holds ``(seq, now)`` when this says False.
    """
    if last < 0 or seq - last <= allowed_jump(now - last_at, interval_s):
        return True
    return held is not None and held[0] < seq <= held[0] + allowed_jump(now - held[1], interval_s)
