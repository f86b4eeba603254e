"""The response objects of the router's own HTTP/1.1 server (``server.py``); the request is in
``request.py``.

They have the shape of the part of ``aiohttp.web`` the handlers use (``Response(status=, body=,
headers=)``, ``StreamResponse`` with ``prepare``, ``write``, ``write_eof``), so ``app.py`` and ``proxy.py``
read as they did on aiohttp.

Bytes go to the client through the connection (``connection.Connection``): a response's head is held
back and sent with its first body bytes (one write, one syscall, for most answers), a stream is sent
chunked, and ``write`` waits while the connection's transport says its buffer is full, so a client
that reads slowly holds the stream back instead of the router buffering it.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from http import HTTPStatus
from typing import TYPE_CHECKING, Any

from multidict import CIMultiDict

if TYPE_CHECKING:
    from llmgw_router.http.request import ClientConnection, Request

_REASONS = {s.value: s.phrase.encode() for s in HTTPStatus}
_REASONS[499] = b"Client Closed Request"
_STATUS_LINES: dict[int, bytes] = {}
# Answers that never have a body, whatever their headers say.
_NO_BODY = frozenset((*range(100, 200), 204, 304))


def status_line(status: int) -> bytes:
    line = _STATUS_LINES.get(status)
    if line is None:
        line = _STATUS_LINES[status] = b"HTTP/1.1 %d %s\r\n" % (status, _REASONS.get(status, b"Unknown"))
    return line


class StreamResponse:
    """A response whose body is written as it comes (chunked on HTTP/1.1)."""

    __slots__ = (
        "_chunked",
        "_conn",
        "_eof",
        "_head",
        "_no_body",
        "headers",
        "raw_headers",
        "status",
        "will_close",
    )

    def __init__(self, *, status: int = 200, headers: Mapping[str, str] | None = None) -> None:
        self.status = status
        # Header lines sent as they are, before ``headers`` (an engine's, relayed: see relay_lines).
        self.raw_headers = b""
        # Taken as is when it is already a CIMultiDict (the proxy builds one per answer).
        self.headers: CIMultiDict[str] = (
            headers if isinstance(headers, CIMultiDict) else CIMultiDict(headers or ())
        )
        self._conn: ClientConnection | None = None
        self._head: bytes | None = None
        self._chunked = False
        self._eof = False
        self._no_body = False
        # Set by force_close() or the connection: the client gets "Connection: close" and the connection ends.
        self.will_close = False

    @property
    def prepared(self) -> bool:
        return self._conn is not None

    def force_close(self) -> None:
        self.will_close = True

    def _build_head(self, request: Request, content_length: int | None) -> bytes:
        conn = request.conn
        self._conn = conn
        self._no_body = request.method == "HEAD"
        if conn.must_close(request):
            self.will_close = True
        parts = [status_line(self.status), self.raw_headers]
        for k, v in self.headers.items():
            if "\n" in v or "\r" in v:  # never let a value split the head (header injection)
                continue
            parts.append(f"{k}: {v}\r\n".encode("latin-1", "replace"))
        if self.status in _NO_BODY:
            # 1xx, 204 and 304 have no body, so no framing (RFC 9110 §6.4.1, 8.6): a "Transfer-Encoding:
            # chunked" and its last chunk would be read as the start of the next answer.
            self._no_body = True
        elif content_length is not None:
            parts.append(b"Content-Length: %d\r\n" % content_length)
        elif request.version == "1.1":
            self._chunked = True
            parts.append(b"Transfer-Encoding: chunked\r\n")
        else:
            # An HTTP/1.0 client reads a body without a length until the connection closes.
            self.will_close = True
        parts.append(conn.date_header)
        parts.append(b"Connection: close\r\n\r\n" if self.will_close else b"\r\n")
        return b"".join(parts)

    async def prepare(self, request: Request) -> None:
        """Commit status and headers (sent with the first body bytes); ConnectionResetError if the
        client is gone."""
        if self._conn is not None:
            return
        if request.conn.gone():
            raise ConnectionResetError("the client has gone")
        # A length the handler set is kept (no chunked framing then); the proxy drops the engine's.
        cl = self.headers.popone("Content-Length", None)
        self._head = self._build_head(request, int(cl) if cl is not None and cl.isdigit() else None)

    def _frame(self, data: bytes) -> bytes:
        if self._no_body:
            data = b""
        elif self._chunked and data:
            data = b"%x\r\n%b\r\n" % (len(data), data)
        head = self._head
        if head is not None:
            self._head = None
            return head + data
        return data

    async def write(self, data: bytes) -> None:
        """Send ``data`` now; waits while the client's buffer is full. ConnectionResetError if gone."""
        conn = self._conn
        if conn is None:
            raise RuntimeError("write() before prepare()")
        if not data:
            return
        await conn.send(self._frame(data))

    async def write_eof(self, data: bytes = b"") -> None:
        """Send ``data`` and end the body."""
        conn = self._conn
        if conn is None or self._eof:
            return
        self._eof = True
        out = self._frame(data)
        if self._chunked and not self._no_body:
            out += b"0\r\n\r\n"
        if out:
            await conn.send(out)


def relay_lines(
    pairs: list[tuple[bytes, bytes]], drop: frozenset[bytes]
) -> tuple[bytes, bytes | None, bytes | None]:
    """Raw header pairs as the head lines :meth:`StreamResponse._build_head` would make of them (those
    named in ``drop``, lower case, left out; a value with CR or LF never sent); with the first
    Content-Type and the first Content-Length among the pairs (None when there is none), which the
    proxy needs too, found in the same pass.

    Fields the engine's ``Connection`` header names are hop-by-hop (RFC 9110 §7.6.1): left out too.
    ``connection`` is expected in ``drop``; the rare answer that names more than ``close`` or
    ``keep-alive`` in it is passed over a second time, with those names dropped as well."""
    lines = []
    ctype = length = named = None
    for k, v in pairs:
        lk = k.lower()
        if lk in drop:
            if length is None and lk == b"content-length":
                length = v
            elif lk == b"connection":
                named = v if named is None else named + b"," + v
            continue
        if ctype is None and lk == b"content-type":
            ctype = v
        if b"\n" in v or b"\r" in v:
            continue
        lines.append(k + b": " + v + b"\r\n")
    if named is not None:
        hop = {t.strip().lower() for t in named.split(b",")} - _PLAIN_CONNECTION
        if hop:
            # Without the Connection fields themselves (dropped anyway), so the second pass has no
            # names to look for.
            kept = [(k, v) for k, v in pairs if (lk := k.lower()) not in hop and lk != b"connection"]
            out, ctype, _ = relay_lines(kept, drop)
            return out, ctype, length
    return b"".join(lines), ctype, length


# Connection header tokens that name no field.
_PLAIN_CONNECTION = frozenset((b"close", b"keep-alive", b""))


class Response(StreamResponse):
    """A whole response: head and body in one write."""

    __slots__ = ("body",)

    def __init__(
        self,
        *,
        status: int = 200,
        body: bytes | None = None,
        text: str | None = None,
        headers: Mapping[str, str] | None = None,
        content_type: str | None = None,
        charset: str | None = None,
    ) -> None:
        super().__init__(status=status, headers=headers)
        if text is not None:
            body = text.encode(charset or "utf-8")
            if content_type is not None or "Content-Type" not in self.headers:
                self.headers["Content-Type"] = f"{content_type or 'text/plain'}; charset={charset or 'utf-8'}"
        elif content_type is not None:
            self.headers["Content-Type"] = content_type + (f"; charset={charset}" if charset else "")
        self.body = body or b""
        if "Content-Type" not in self.headers and self.body:
            self.headers["Content-Type"] = "application/octet-stream"

    async def prepare(self, request: Request) -> None:
        if self._conn is not None:
            return
        if request.conn.gone():
            raise ConnectionResetError("the client has gone")
        self.headers.popall("Content-Length", None)
        self._head = self._build_head(request, len(self.body))

    def whole(self, request: Request) -> bytes:
        """What ``prepare`` then ``write_eof()`` would send, as one piece (the response is then ended);
        ConnectionResetError if the client is gone."""
        if request.conn.gone():
            raise ConnectionResetError("the client has gone")
        self.headers.popall("Content-Length", None)
        head = self._build_head(request, len(self.body))
        self._eof = True
        return head if self._no_body else head + self.body

    async def write_eof(self, data: bytes = b"") -> None:
        conn = self._conn
        if conn is None or self._eof:
            return
        self._eof = True
        out = (self._head or b"") + (b"" if self._no_body else self.body + data)
        self._head = None
        await conn.send(out)


class RelayedResponse(Response):
    """An engine's whole answer, relayed: its header lines (:func:`relay_lines`) as they came."""

    __slots__ = ()

    def __init__(self, status: int, body: bytes, lines: bytes, has_type: bool) -> None:
        StreamResponse.__init__(self, status=status)
        self.raw_headers = lines
        self.body = body
        if not has_type and body:
            self.headers["Content-Type"] = "application/octet-stream"

    def whole(self, request: Request) -> bytes:
        """:meth:`Response.whole`'s bytes, made without its pass over the (empty) header dict: the
        answer to nearly every proxied request that is not a stream goes this way."""
        if self.headers or self.status in _NO_BODY or request.method == "HEAD":
            return Response.whole(self, request)
        conn = request.conn
        if conn.gone():
            raise ConnectionResetError("the client has gone")
        self._conn = conn
        if conn.must_close(request):
            self.will_close = True
        self._eof = True
        body = self.body
        return b"%b%bContent-Length: %d\r\n%b%b%b" % (
            status_line(self.status),
            self.raw_headers,
            len(body),
            conn.date_header,
            b"Connection: close\r\n\r\n" if self.will_close else b"\r\n",
            body,
        )


def json_response(obj: Any, status: int = 200) -> Response:
    return Response(status=status, text=json.dumps(obj), content_type="application/json")
