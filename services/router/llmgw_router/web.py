"""The request and response objects of the router's own HTTP/1.1 server (``http_server.py``).

They have the shape of the part of ``aiohttp.web`` the handlers use (``request.headers``, ``.path``,
``.method``, the body; ``Response(status=, body=, headers=)``, ``StreamResponse`` with ``prepare``,
``write``, ``write_eof``), so ``app.py`` and ``proxy.py`` read as they did on aiohttp. What they do
not have is everything a proxy never uses: no cookies, no URL objects, no middleware, no per-request
task-local state beyond a small dict.

Bytes go to the client through the connection (``http_connection.Connection``): a response's head is held
back and sent with its first body bytes (one write, one syscall, for most answers), a stream is sent
chunked, and ``write`` waits while the connection's transport says its buffer is full, so a client
that reads slowly holds the stream back instead of the router buffering it.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Mapping
from http import HTTPStatus
from typing import TYPE_CHECKING, Any, Generic, TypeVar, cast, overload

from multidict import CIMultiDict

from llmgw_common.errors import Refused

if TYPE_CHECKING:
    from llmgw_router.http_connection import Connection

T = TypeVar("T")

_REASONS = {s.value: s.phrase.encode() for s in HTTPStatus}
_REASONS[499] = b"Client Closed Request"
_STATUS_LINES: dict[int, bytes] = {}


def status_line(status: int) -> bytes:
    line = _STATUS_LINES.get(status)
    if line is None:
        line = _STATUS_LINES[status] = b"HTTP/1.1 %d %s\r\n" % (status, _REASONS.get(status, b"Unknown"))
    return line


class HTTPRequestEntityTooLarge(Refused):
    """The request body grew past the server's limit while it was read (a chunked body)."""


class RequestKey(Generic[T]):
    """A typed key for a value a handler stores on the request (``request[key] = value``)."""

    __slots__ = ("name",)

    def __init__(self, name: str, _: type[T]) -> None:
        self.name = name


class Request:
    """One request: method, path, headers now; the body as it arrives (``read()``)."""

    __slots__ = (
        "_body",
        "_conn",
        "_expect_continue",
        "_headers",
        "_raw_headers",
        "_size",
        "_store",
        "_too_large",
        "_waiter",
        "authorization",
        "complete",
        "content_length",
        "keep_alive",
        "match_info",
        "method",
        "path",
        "query_string",
        "version",
    )

    def __init__(
        self,
        conn: Connection,
        method: str,
        path: str,
        query_string: str,
        raw_headers: list[tuple[bytes, bytes]],
        version: str,
        keep_alive: bool,
    ) -> None:
        self._conn = conn
        self.method = method
        self.path = path
        self.query_string = query_string
        # The headers as the parser gave them; a CIMultiDict of them only if a handler asks for one
        # (a proxied request reads two or three headers: a lookup in the raw list is cheaper).
        self._raw_headers = raw_headers
        self._headers: CIMultiDict[str] | None = None
        self.version = version
        self.keep_alive = keep_alive
        # The three headers every request's handling reads, found in one pass (first of each).
        cl = expect = auth = None
        for k, v in raw_headers:
            n = len(k)
            if n == 14:
                if cl is None and k.lower() == b"content-length":
                    cl = v.decode("utf-8", "surrogateescape")
            elif n == 13:
                if auth is None and k.lower() == b"authorization":
                    auth = v.decode("utf-8", "surrogateescape")
            elif n == 6 and expect is None and k.lower() == b"expect":
                expect = v.decode("utf-8", "surrogateescape")
        self.content_length = int(cl) if cl is not None and cl.isdigit() else None
        # ``headers.get("Authorization")``
        self.authorization = auth
        self.match_info: dict[str, str] = {}
        # The body as it arrived, and whether all of it has (the parser saw the message's end).
        self._body: list[bytes] = []
        self._size = 0
        self._too_large = False
        self.complete = False
        self._waiter: asyncio.Future[None] | None = None
        self._store: dict[RequestKey[Any], Any] | None = None
        self._expect_continue = expect is not None and expect.lower() == "100-continue"

    # ------------------------------------------------------------ headers

    @property
    def headers(self) -> CIMultiDict[str]:
        h = self._headers
        if h is None:
            h = self._headers = CIMultiDict(
                [(k.decode("latin-1"), v.decode("utf-8", "surrogateescape")) for k, v in self._raw_headers]
            )
        return h

    def header(self, lname: bytes) -> str | None:
        """The first value of the header named ``lname`` (lower case), as ``headers.get`` gives it."""
        n = len(lname)
        for k, v in self._raw_headers:
            if len(k) == n and k.lower() == lname:
                return v.decode("utf-8", "surrogateescape")
        return None

    # ------------------------------------------------------------ per-request values

    def __setitem__(self, key: RequestKey[T], value: T) -> None:
        if self._store is None:
            self._store = {}
        self._store[key] = value

    def __getitem__(self, key: RequestKey[T]) -> T:
        if self._store is None:
            raise KeyError(key.name)
        return cast(T, self._store[key])

    @overload
    def get(self, key: RequestKey[T]) -> T | None: ...
    @overload
    def get(self, key: RequestKey[T], default: T) -> T: ...
    def get(self, key: RequestKey[T], default: T | None = None) -> T | None:
        if self._store is None:
            return default
        return cast("T | None", self._store.get(key, default))

    # ------------------------------------------------------------ what the landing page shows

    @property
    def scheme(self) -> str:
        return "http"

    @property
    def host(self) -> str:
        return self.headers.get("Host", "")

    # ------------------------------------------------------------ body

    @property
    def content(self) -> Request:
        """aiohttp's name for the body stream: ``is_eof()``, ``read_nowait()`` are on the request itself."""
        return self

    def is_eof(self) -> bool:
        """The whole body has arrived (False past the size limit: then :meth:`read` raises at once)."""
        return self.complete and not self._too_large

    def read_nowait(self) -> bytes:
        """What has arrived of the body (all of it when :meth:`is_eof`)."""
        body = self._body
        if not body:
            return b""
        if len(body) > 1:
            body[:] = [b"".join(body)]
        return body[0]

    async def read(self) -> bytes:
        """The whole body; raises :class:`HTTPRequestEntityTooLarge` past the limit."""
        if self._expect_continue:
            self._expect_continue = False
            if not self.complete:
                self._conn.write_continue()
        while not self.complete and not self._too_large:
            w = self._waiter = asyncio.get_running_loop().create_future()
            try:
                await w
            finally:
                self._waiter = None
            if self._conn.lost:
                raise ConnectionResetError("the client has gone")
        if self._too_large:
            raise HTTPRequestEntityTooLarge()
        return self.read_nowait()

    # ------------------------------------------------------------ fed by the connection

    def _feed(self, data: bytes, limit: int) -> None:
        if self._too_large:
            return
        self._size += len(data)
        if self._size > limit:
            # Drop what came: a client streaming gigabytes must not become our memory.
            self._too_large = True
            self._body.clear()
        else:
            self._body.append(data)
        if self._too_large:
            self._wake()

    def _complete(self) -> None:
        self.complete = True
        self._wake()

    def _wake(self) -> None:
        w = self._waiter
        if w is not None and not w.done():
            w.set_result(None)


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
        self._conn: Connection | None = None
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
        conn = request._conn
        self._conn = conn
        self._no_body = request.method == "HEAD"
        if conn.must_close(request):
            self.will_close = True
        parts = [status_line(self.status), self.raw_headers]
        for k, v in self.headers.items():
            if "\n" in v or "\r" in v:  # never let a value split the head (header injection)
                continue
            parts.append(f"{k}: {v}\r\n".encode("latin-1", "replace"))
        if content_length is not None:
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
        if request._conn.gone():
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
    proxy needs too, found in the same pass."""
    lines = []
    ctype = length = None
    for k, v in pairs:
        lk = k.lower()
        if lk in drop:
            if length is None and lk == b"content-length":
                length = v
            continue
        if ctype is None and lk == b"content-type":
            ctype = v
        if b"\n" in v or b"\r" in v:
            continue
        lines.append(k + b": " + v + b"\r\n")
    return b"".join(lines), ctype, length


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
        if request._conn.gone():
            raise ConnectionResetError("the client has gone")
        self.headers.popall("Content-Length", None)
        self._head = self._build_head(request, len(self.body))

    def whole(self, request: Request) -> bytes:
        """What ``prepare`` then ``write_eof()`` would send, as one piece (the response is then ended);
        ConnectionResetError if the client is gone."""
        if request._conn.gone():
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


def json_response(obj: Any, status: int = 200) -> Response:
    return Response(status=status, text=json.dumps(obj), content_type="application/json")
