"""W3C Trace Context (``traceparent``, ``tracestate``): read as a receiver must, written as version 00.

A ``traceparent`` that does not parse is not an error for the request that carries it: the receiver
starts a new trace, and never passes the header on as it came (W3C Trace Context, "Processing
model"). So :func:`parse_traceparent` answers None for anything it would not forward, and what is
forwarded is always made anew by :func:`format_traceparent`.

The rules, level 1 and 2: ``VV-TTTT…(32)-PPPP…(16)-FF``, lower-case hex only; version ``ff`` is
invalid; a trace id or parent id of all zeros is invalid; version 00 is exactly 55 characters; a later
version may be longer, its first 55 characters read as version 00's and followed by ``-``. One bound
of our own: past :data:`MAX_TRACEPARENT` characters (far beyond any version the spec could define in
the header's 512-character budget) the value is not read at all.

``tracestate`` travels only with a valid ``traceparent``: at most 512 characters and 32 list members
(the spec's limits for what must be propagated), printable ASCII; otherwise it is dropped, not
repaired (the vendors' entries in it are theirs to read, not ours).
"""

from __future__ import annotations

import re
from typing import NamedTuple

MAX_TRACEPARENT = 256
MAX_TRACESTATE = 512
MAX_TRACESTATE_MEMBERS = 32
SAMPLED = 0x01

_TRACEPARENT = re.compile(r"([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})")
_PRINTABLE = re.compile(r"[\x20-\x7e]*")


class TraceParent(NamedTuple):
    trace_id: int
    span_id: int
    flags: int

    @property
    def sampled(self) -> bool:
        return bool(self.flags & SAMPLED)


_ZERO_TRACE = "0" * 32
_ZERO_SPAN = "0" * 16


def canonical_traceparent(value: str | None) -> str | None:
    """A ``traceparent`` header as version 00 carries it, or None: absent, oversized or malformed.

    What a proxy that forwards it needs, without reading the ids as numbers (the router with tracing
    off): a valid version-00 header is itself; a later version's is cut to version 00's fields."""
    if value is None or len(value) > MAX_TRACEPARENT:
        return None
    value = value.strip(" \t")
    m = _TRACEPARENT.match(value)
    if m is None:
        return None
    version = m.group(1)
    if version == "ff" or m.group(2) == _ZERO_TRACE or m.group(3) == _ZERO_SPAN:
        return None
    if version == "00":
        return value if len(value) == 55 else None
    if len(value) != 55 and value[55] != "-":
        return None
    # A later version's flags may mean what version 00 does not know: only the bits it defines pass
    # on (sampled, and level 2's random trace id).
    return f"00-{m.group(2)}-{m.group(3)}-{int(m.group(4), 16) & 0x03:02x}"


def parse_traceparent(value: str | None) -> TraceParent | None:
    """The parent a ``traceparent`` header names, or None: absent, oversized or malformed."""
    canonical = canonical_traceparent(value)
    if canonical is None:
        return None
    return TraceParent(int(canonical[3:35], 16), int(canonical[36:52], 16), int(canonical[53:55], 16))


def format_traceparent(trace_id: int, span_id: int, flags: int) -> str:
    return f"00-{trace_id:032x}-{span_id:016x}-{flags & 0xFF:02x}"


def clean_tracestate(value: str | None) -> str | None:
    """``tracestate`` as it may be forwarded, or None to drop it (absent, too long, too many members,
    not printable ASCII, a member that is not ``key=value``)."""
    if not value or len(value) > MAX_TRACESTATE or _PRINTABLE.fullmatch(value) is None:
        return None
    members = [m.strip(" \t") for m in value.split(",")]
    members = [m for m in members if m]
    if not members or len(members) > MAX_TRACESTATE_MEMBERS:
        return None
    for m in members:
        key, eq, val = m.partition("=")
        if not eq or not key or not val:
            return None
    return ",".join(members)


def header_lines(parent: TraceParent | str, tracestate: str | None) -> bytes:
    """The HTTP/1.1 header lines that carry ``parent`` (or a canonical header) and ``tracestate`` to an
    engine."""
    value = parent if isinstance(parent, str) else format_traceparent(*parent)
    line = b"traceparent: " + value.encode() + b"\r\n"
    if tracestate:
        line += b"tracestate: " + tracestate.encode() + b"\r\n"
    return line
