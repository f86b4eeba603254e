"""Replies larger than one NATS message, sent as numbered chunks to the request's reply inbox.

A ctl answer grows with the fleet (``ctl nodes`` at 5,000 nodes is about 3 MB) while one NATS message
is bounded by the server's ``max_payload`` (1 MiB by default, and the client refuses to publish more).
Chunking the encoded reply fits any size under any limit, for every verb alike, and keeps the answer
one snapshot: pages fetched one request at a time would each see a different moment.

Protocol: a reply that fits is one plain message, as before. A larger one is cut into ``n`` parts of at
most ``max_payload - HEADROOM`` bytes, each with the header ``Llmgw-Chunk: i/n`` (1-based), published in
order to the reply subject (one connection keeps the order). The requester reads ``n`` messages on its
own inbox and joins them. A client that predates this reads the first part only and fails to decode
it: an error, never a silently short answer.
"""

from __future__ import annotations

from llmgw_common.errors import BadMessage

CHUNK_HEADER = "Llmgw-Chunk"
# Room for the headers, which count against max_payload along with the data.
HEADROOM = 1024
# A bound on what a requester will collect (at 1 MiB a part: 4 GiB), against a corrupt header.
MAX_CHUNKS = 4096


class ChunkError(BadMessage):
    """A chunk header that does not fit the sequence being read."""


def split(data: bytes, max_payload: int) -> list[bytes]:
    """``data`` in parts that each fit a message under ``max_payload`` (one part when it fits)."""
    size = max_payload - HEADROOM
    if size <= 0:
        raise ValueError(f"max_payload {max_payload} leaves no room for data")
    if len(data) <= size:
        return [data]
    parts = [data[i : i + size] for i in range(0, len(data), size)]
    if len(parts) > MAX_CHUNKS:
        raise ValueError(f"a reply of {len(data)} bytes needs {len(parts)} chunks, more than {MAX_CHUNKS}")
    return parts


def header(index: int, count: int) -> dict[str, str]:
    return {CHUNK_HEADER: f"{index}/{count}"}


def parse(value: str, expect_index: int, expect_count: int | None) -> int:
    """The chunk count from header ``value``; raises :class:`ChunkError` unless it is part ``expect_index``
    (1-based) of ``expect_count`` (None: not known yet, i.e. the first part)."""
    try:
        i_text, n_text = value.split("/")
        index, count = int(i_text), int(n_text)
    except ValueError:
        raise ChunkError(f"unreadable chunk header {value!r}") from None
    if not 1 <= count <= MAX_CHUNKS:
        raise ChunkError(f"chunk header {value!r}: count out of range")
    if index != expect_index or (expect_count is not None and count != expect_count):
        want = f"{expect_index}/{expect_count}" if expect_count is not None else f"{expect_index}/n"
        raise ChunkError(f"chunk {value!r} arrived where {want} was due")
    return count
