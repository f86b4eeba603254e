"""Stored responses: the Responses API keeps a response in one replica's memory, so what refers to it
(``previous_response_id``, ``GET /v1/responses/{id}``, ``/cancel``) must reach that replica, from any
router, after a router restart too, without a lookup on the request path.

The replica is written into the id itself. Every response id in an answer the router relays
(``"resp_<rest>"`` as a JSON string value) becomes ``resp_lg<tag><rest>``, where ``<tag>`` is 16 hex
digits of the replica's stable id (the blake2b hash every router computes alike); a tagged id coming
back is read for its replica and sent to the engine as it made it. A tag no replica has any more means
the response is gone with its replica: a clear 404, never a guess at another replica.
"""

from __future__ import annotations

import re

TAG_MARK = "resp_lg"
# A replica's tag: 16 hex digits (routing.endpoints.tag_of).
_TAG_LEN = 16
_HEX = frozenset("0123456789abcdef")
# A string value (after ``:``, ``,`` or ``[``) that begins ``resp_``: inside a string a quote is
# always escaped, so generated text that mentions an id is never matched.
_VALUE = re.compile(rb'([:,\[]\s*)"resp_')
# A line of a stream held back at most this long waiting for its end; past it, it is passed on as is.
_MAX_HELD = 1 << 20


def tag_ids(data: bytes, tag: str) -> bytes:
    """``data`` (a JSON answer, or whole SSE lines) with each response id tagged with ``tag``."""
    if b'"resp_' not in data:
        return data
    return _VALUE.sub(rb'\1"' + TAG_MARK.encode() + tag.encode(), data)


def untag(response_id: str) -> tuple[str, str] | None:
    """(tag, the engine's id) of a tagged id; None for an id the router did not tag."""
    if not response_id.startswith(TAG_MARK):
        return None
    tag = response_id[len(TAG_MARK) : len(TAG_MARK) + _TAG_LEN]
    rest = response_id[len(TAG_MARK) + _TAG_LEN :]
    if len(tag) != _TAG_LEN or not rest or not _HEX.issuperset(tag):
        return None
    return tag, "resp_" + rest


class StreamTagger:
    """:func:`tag_ids` over a stream: bytes are passed on up to the last line end seen, so an id split
    between two reads is still found whole."""

    __slots__ = ("_held", "_tag")

    def __init__(self, tag: str) -> None:
        self._tag = tag
        self._held = b""

    def feed(self, data: bytes) -> bytes:
        if self._held:
            data = self._held + data
        cut = data.rfind(b"\n") + 1
        if cut == 0 and len(data) < _MAX_HELD:
            self._held = data
            return b""
        if cut == 0:
            cut = len(data)
        self._held = data[cut:]
        return tag_ids(data[:cut], self._tag)

    def flush(self) -> bytes:
        out, self._held = self._held, b""
        return tag_ids(out, self._tag)
