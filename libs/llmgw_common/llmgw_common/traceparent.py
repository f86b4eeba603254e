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


def parse_traceparent(value: str | None) -> TraceParent | None:
    """The parent a ``traceparent`` header names, or None: absent, oversized or malformed."""
    if value is None or len(value) > MAX_TRACEPARENT:
        return None
    value = value.strip(" \t")
    m = _TRACEPARENT.match(value)
    if m is None:
        return None
    version = m.group(1)
    if version == "ff":
        return None
    if len(value) != 55 and (version == "00" or value[55] != "-"):
        return None
    trace_id = int(m.group(2), 16)
    span_id = int(m.group(3), 16)
    if trace_id == 0 or span_id == 0:
        return None
    flags = int(m.group(4), 16)
    # A later version's flags may mean what version 00 does not know: only the bits it defines pass
    # on (sampled, and level 2's random trace id).
    return TraceParent(trace_id, span_id, flags if version == "00" else flags & 0x03)


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


def header_lines(parent: TraceParent, tracestate: str | None) -> bytes:
    """The HTTP/1.1 header lines that carry ``parent`` (and ``tracestate``) to an engine."""
    line = b"traceparent: " + format_traceparent(*parent).encode() + b"\r\n"
    if tracestate:
        line += b"tracestate: " + tracestate.encode() + b"\r\n"
    return line
