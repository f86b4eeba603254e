"""The request object of the router's own HTTP/1.1 server (``server.py``): method, path, headers,
the body as it arrives; the answer is in ``response.py``.

It has the shape of the part of ``aiohttp.web.Request`` the handlers use (``request.headers``, ``.path``,
``.method``, the body), so ``app.py`` and ``proxy.py`` read as they did on aiohttp. What it does not have
is everything a proxy never uses: no cookies, no URL objects, no middleware, no per-request task-local
state beyond a small dict.
"""

from __future__ import annotations

import asyncio
from typing import Any, Generic, Protocol, TypeVar, cast, overload

from multidict import CIMultiDict

from llmgw_common.errors import Refused

T = TypeVar("T")


class ClientConnection(Protocol):
    """What a request and its answer ask of the client connection they came on
    (:class:`llmgw_router.http.connection.Connection`), named here by use: the connection imports the
    request and response modules, so they do not import it."""

    lost: bool
    trust_forwarded: bool

    @property
    def date_header(self) -> bytes: ...

    def write_continue(self) -> None: ...

    def gone(self) -> bool: ...

    def must_close(self, req: Request) -> bool: ...

    async def send(self, data: bytes) -> None: ...


# Body pieces kept as they came; past this many, gathered in one buffer (Request._feed).
_PIECES = 64


def _forwarded(name: bytes) -> bool:
    n = name.lower()
    return n.startswith(b"x-forwarded-") or n == b"forwarded"


def _chunked_last(te: bytes) -> bool:
    return te.rpartition(b",")[2].strip().lower() == b"chunked"


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
        "_coalesced",
        "_expect_continue",
        "_headers",
        "_raw_headers",
        "_size",
        "_store",
        "_too_large",
        "_waiter",
        "authorization",
        "complete",
        "conn",
        "content_length",
        "keep_alive",
        "match_info",
        "method",
        "path",
        "problem",
        "query_string",
        "traceparent",
        "version",
    )

    def __init__(
        self,
        conn: ClientConnection,
        method: str,
        path: str,
        query_string: str,
        raw_headers: list[tuple[bytes, bytes]],
        version: str,
        keep_alive: bool,
    ) -> None:
        # The connection it came on: its answer is written there (http.response).
        self.conn = conn
        self.method = method
        self.path = path
        self.query_string = query_string
        # The headers as the parser gave them; a CIMultiDict of them only if a handler asks for one
        # (a proxied request reads two or three headers: a lookup in the raw list is cheaper).
        self._raw_headers = raw_headers
        self._headers: CIMultiDict[str] | None = None
        self.version = version
        self.keep_alive = keep_alive
        # The headers every request's handling reads, found in one pass (first of each).
        cl = expect = auth = tp = None
        # What makes the request one to refuse (400) before any handler sees it: the connection reads it.
        self.problem: tuple[int, str] | None = None
        hosts = 0
        for k, v in raw_headers:
            n = len(k)
            if n == 14:
                if cl is None and k.lower() == b"content-length":
                    cl = v.decode("utf-8", "surrogateescape")
            elif n == 13:
                if k.lower() == b"authorization":
                    if auth is None:
                        auth = v.decode("utf-8", "surrogateescape")
                    else:
                        # Which one a proxy in front checked is unknown: refuse rather than pick.
                        self.problem = (400, "more than one Authorization header")
            elif n == 4:
                if k.lower() == b"host":
                    hosts += 1
            elif n == 6:
                if expect is None and k.lower() == b"expect":
                    expect = v.decode("utf-8", "surrogateescape")
            elif n == 11 and k.lower() == b"traceparent":
                # W3C Trace Context: two make it invalid ("", which no reader takes for a trace).
                tp = v.decode("utf-8", "surrogateescape") if tp is None else ""
            elif n == 17 and k.lower() == b"transfer-encoding" and v.strip().lower() != b"chunked":
                # Not chunked last: llhttp refuses it only after the head (the handler would have
                # started; RFC 9112 §6.3: 400). Another coding before chunked (gzip, chunked): llhttp
                # takes it, and the body would be gzip read as JSON; RFC 9112 §6.1: 501.
                self.problem = (
                    (501, "only Transfer-Encoding: chunked is supported")
                    if _chunked_last(v)
                    else (400, "Transfer-Encoding must end with chunked")
                )
        if hosts != 1 and (hosts or version == "1.1"):
            # RFC 9112 §3.2: an HTTP/1.1 request without Host, or any with two, is a 400.
            self.problem = (400, "a request needs exactly one Host header")
        self.content_length = int(cl) if cl is not None and cl.isdigit() else None
        # ``headers.get("Authorization")`` (the only one: a second is refused)
        self.authorization = auth
        # The W3C ``traceparent`` as it came ("" when there were several): the router passes it on to
        # its engine, or traces under it. Found here, in the pass already made, not by a lookup.
        self.traceparent = tp
        self.match_info: dict[str, str] = {}
        # The body as it arrived, and whether all of it has (the parser saw the message's end).
        self._body: list[bytes] = []
        # The body once it came in more than _PIECES pieces (tiny chunks): one buffer, not an object each.
        self._coalesced: bytearray | None = None
        self._size = 0
        self._too_large = False
        self.complete = False
        self._waiter: asyncio.Future[None] | None = None
        self._store: dict[RequestKey[Any], Any] | None = None
        # An HTTP/1.0 client knows no 100 Continue (RFC 9110 §10.1.1): it is sent the answer only.
        self._expect_continue = expect is not None and version == "1.1" and expect.lower() == "100-continue"

    # ------------------------------------------------------------ headers

    @property
    def headers(self) -> CIMultiDict[str]:
        """The headers; ``Forwarded`` and ``X-Forwarded-*`` only from a trusted proxy (``trusted_proxies``):
        from anyone else they are what the client says, and the landing page would show a URL a shared
        cache then serves to others ("send your key to attacker.example")."""
        h = self._headers
        if h is None:
            trusted = self._trusted()
            h = self._headers = CIMultiDict(
                [
                    (k.decode("latin-1"), v.decode("utf-8", "surrogateescape"))
                    for k, v in self._raw_headers
                    if trusted or not _forwarded(k)
                ]
            )
        return h

    def _trusted(self) -> bool:
        c = self.conn
        return c is not None and c.trust_forwarded

    def header(self, lname: bytes) -> str | None:
        """The first value of the header named ``lname`` (lower case), as ``headers.get`` gives it."""
        if (lname.startswith(b"x-forwarded-") or lname == b"forwarded") and not self._trusted():
            return None
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
        if self._coalesced is not None:
            return bytes(self._coalesced)
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
                self.conn.write_continue()
        while not self.complete and not self._too_large:
            w = self._waiter = asyncio.get_running_loop().create_future()
            try:
                await w
            finally:
                self._waiter = None
            if self.conn.lost:
                raise ConnectionResetError("the client has gone")
        if self._too_large:
            raise HTTPRequestEntityTooLarge()
        return self.read_nowait()

    # ------------------------------------------------------------ fed by the connection

    def feed(self, data: bytes, limit: int) -> None:
        if self._too_large:
            return
        self._size += len(data)
        if self._size > limit:
            # Drop what came: a client streaming gigabytes must not become our memory.
            self._too_large = True
            self._body.clear()
            self._coalesced = None
        elif self._coalesced is not None:
            self._coalesced += data
        elif len(self._body) < _PIECES:
            self._body.append(data)
        else:
            # A body in many small pieces (one-byte chunks): each piece as its own object would cost
            # about 33 bytes more than its data, so max_body_bytes of them would be 30 times that.
            self._coalesced = bytearray(b"".join(self._body))
            self._coalesced += data
            self._body.clear()
        if self._too_large:
            self.wake()

    def end_body(self) -> None:
        self.complete = True
        self.wake()

    def wake(self) -> None:
        """Wake a :meth:`read` waiting for the body (more came, its end, the connection lost)."""
        w = self._waiter
        if w is not None and not w.done():
            w.set_result(None)
