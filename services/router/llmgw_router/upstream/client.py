"""A small HTTP/1.1 client for the router's one kind of upstream request: POST a body, relay the answer.

Why not aiohttp's client: in the router's profile ``ClientSession._request`` and its helpers (tracing,
cookies, redirects, auth, proxies, header merging) were about 40% of the CPU per proxied request, for
features the router never uses. This client is keep-alive connections pooled per endpoint (each an
``asyncio.Protocol`` with httptools' parser, what uvicorn uses: ``connection.py``), flow control
on the read side, and typed errors that say whether anything came back. Bodies arrive de-chunked, as
the bytes the engine wrote.
"""

from __future__ import annotations

import asyncio
import ssl
import time
from urllib.parse import urlsplit

from llmgw_router.upstream.connection import (
    Aborted,
    Answers,
    ConnectFailed,
    Disconnected,
    UpstreamConnection,
)


class UpstreamResponse:
    """An engine's answer: status and headers now, the body by :meth:`readany` or :meth:`read`."""

    __slots__ = (
        "_aborted",
        "_client",
        "_conn",
        "_done",
        "_key",
        "_read_timeout",
        "_stall_timeout",
        "headers",
        "status",
    )

    def __init__(
        self,
        client: UpstreamClient,
        key: tuple[str, int, bool],
        conn: UpstreamConnection,
        read_timeout: float,
        stall_timeout: float,
    ) -> None:
        self._client, self._key, self._conn = client, key, conn
        # The wait for the first bytes of the body (a long prefill may precede them), then for each next.
        self._read_timeout, self._stall_timeout = read_timeout, min(stall_timeout, read_timeout)
        self.status = conn.status
        self.headers = conn.headers
        # Set once the connection has gone back to the pool or been closed: it is no longer ours.
        self._done = False
        self._aborted: Aborted | None = None

    def header(self, name: bytes) -> bytes | None:
        name = name.lower()
        for k, v in self.headers:
            if k.lower() == name:
                return v
        return None

    @property
    def content_length(self) -> int | None:
        v = self.header(b"content-length")
        return int(v) if v is not None and v.isdigit() else None

    def at_eof(self) -> bool:
        """Whole answer received and every byte handed out."""
        return self._done or (self._conn.complete and not self._conn.chunks)

    async def readany(self) -> bytes:
        """The bytes received so far (waiting for some); b"" at the end."""
        if self._done:
            if self._aborted is not None:
                raise self._aborted
            return b""
        c = self._conn
        while not c.chunks:
            if c.complete:
                self._finish()
                return b""
            await c.wait(self._read_timeout)
        data = c.take()
        # The answer has started: from here a silence is a stall, not a prefill.
        self._read_timeout = self._stall_timeout
        if c.complete and not c.chunks:
            self._finish()
        return data

    def take_whole(self) -> bytes | None:
        """The whole body when all of it is here already (a short answer usually is), taken without a
        wait; None when more is to come (then :meth:`read`), or when it was already handed out."""
        c = self._conn
        if self._done or not c.complete:
            return None
        data = c.take()
        self._finish()
        return data

    async def read(self) -> bytes:
        data = self.take_whole()
        if data is not None:
            return data
        parts: list[bytes] = []
        while True:
            data = await self.readany()
            if not data:
                return b"".join(parts)
            parts.append(data)

    def _finish(self) -> None:
        """The answer is complete: the connection goes back to the pool (or is closed)."""
        self._done = True
        c = self._conn
        if c.keep_alive and not c.closed:
            self._client._release(self._key, c)
        else:
            c.close()

    def close(self) -> None:
        """Abandon the answer: closing the connection tells the engine to stop (no-op when finished)."""
        if not self._done:
            self._done = True
            self._conn.close()

    def abort(self, reason: str) -> None:
        """Give up on the answer now: a read waiting on it, and any later one, raises :class:`Aborted`.

        For an engine that is gone without closing its connection (a lost node): the read would
        otherwise wait out its timeout. No-op once the answer is complete.
        """
        if self._done:
            return
        e = Aborted(reason)
        e.responded = True
        self._aborted = e
        self._done = True
        self._conn._fail(e)
        self._conn.close()

    def withdraw(self, reason: str, silence_s: float) -> None:
        """Its endpoint left the routing table: :meth:`abort` once the engine has been silent for
        ``silence_s`` (:meth:`UpstreamConnection.withdraw`); an answer still flowing finishes."""
        if not self._done:
            self._conn.withdraw(reason, silence_s, self.abort)


class UpstreamClient:
    """Keep-alive connections per endpoint; ``post()`` sends a body and returns the :class:`UpstreamResponse`."""

    def __init__(
        self,
        connect_timeout_s: float,
        read_timeout_s: float,
        idle_timeout_s: float = 30.0,
        stall_timeout_s: float | None = None,
        max_idle_per_endpoint: int = 128,
    ) -> None:
        self.connect_timeout_s = connect_timeout_s
        self.read_timeout_s = read_timeout_s
        # Silence allowed between bytes once an answer has started (read_timeout_s when None or longer).
        self.stall_timeout_s = read_timeout_s if stall_timeout_s is None else stall_timeout_s
        self.idle_timeout_s = idle_timeout_s
        # A burst opens as many connections as it needs; only this many wait for reuse afterwards.
        self.max_idle_per_endpoint = max_idle_per_endpoint
        self._idle: dict[tuple[str, int, bool], list[UpstreamConnection]] = {}
        self._targets: dict[str, tuple[tuple[str, int, bool], bytes, bytes]] = {}
        # (base URL, path, content type) -> its connection key and request head up to the length's value.
        self._heads: dict[tuple[str, str, bytes], tuple[tuple[str, int, bool], bytes]] = {}
        self._ssl: ssl.SSLContext | None = None

    def _target(self, base_url: str) -> tuple[tuple[str, int, bool], bytes, bytes]:
        t = self._targets.get(base_url)
        if t is None:
            u = urlsplit(base_url)
            tls = u.scheme == "https"
            host = u.hostname or "127.0.0.1"
            port = u.port or (443 if tls else 80)
            host_header = (u.netloc or host).encode("idna")
            t = self._targets[base_url] = ((host, port, tls), host_header, u.path.rstrip("/").encode())
        return t

    def _head_of(
        self, base_url: str, path: str, content_type: bytes, method: bytes = b"POST"
    ) -> tuple[tuple[str, int, bool], bytes]:
        key, host_header, prefix = self._target(base_url)
        start = (
            method
            + b" "
            + prefix
            + path.encode()
            + b" HTTP/1.1\r\nHost: "
            + host_header
            + b"\r\nContent-Type: "
            + content_type
            + b"\r\nAccept-Encoding: identity\r\nContent-Length: "
        )
        if method != b"POST" or content_type.startswith(b"multipart/"):
            return key, start  # a GET's path carries an id, a form's type a boundary: one use each
        if len(self._heads) >= 1024:  # endpoints come and go: never more than this many remembered
            self._heads.clear()
        self._heads[(base_url, path, content_type)] = (key, start)
        return key, start

    async def post(
        self,
        base_url: str,
        path: str,
        body: bytes,
        content_type: bytes = b"application/json",
        held: Answers | None = None,
        method: bytes = b"POST",
        extra: bytes = b"",
    ) -> UpstreamResponse:
        """POST ``body`` to ``base_url + path``; raises an :class:`UpstreamError` before any answer.

        ``held``: while the answer's head is awaited its connection is in this set, to be aborted.
        ``method``: another method (a stored response is read with GET; ``path`` may carry a query).
        ``extra``: header lines of this request alone, each ending in CRLF (the trace context).
        """
        t = self._heads.get((base_url, path, content_type)) if method == b"POST" else None
        if t is None:
            t = self._head_of(base_url, path, content_type, method)
        key, head_start = t
        if extra:
            head = b"%b%d\r\n%b\r\n" % (head_start, len(body), extra)
        else:
            head = b"%b%d\r\n\r\n" % (head_start, len(body))
        conn, reused = self._take(key)
        if conn is None:
            conn = await self._connect(key)
        try:
            return await self._exchange(key, conn, head, body, held)
        except Disconnected as e:
            if not reused or e.responded:
                raise
        # A kept-alive connection the engine had closed meanwhile: one more try on a new one.
        conn = await self._connect(key)
        return await self._exchange(key, conn, head, body, held)

    async def _exchange(
        self,
        key: tuple[str, int, bool],
        conn: UpstreamConnection,
        head: bytes,
        body: bytes,
        held: Answers | None,
    ) -> UpstreamResponse:
        assert conn.transport is not None
        conn.reset()
        conn.last_data_at = conn.loop.time()
        if held is not None:
            held.add(conn)
        try:
            if conn.transport.is_closing():
                # Closed under us before the protocol was told (an engine killed: the connection
                # lost on this turn of the loop, connection_lost on a later one).
                raise Disconnected("the engine closed the connection")
            try:
                conn.transport.writelines((head, body))
            except RuntimeError as e:  # uvloop: "unable to perform operation ...; the handler is closed"
                raise Disconnected(f"the engine closed the connection: {e}") from None
            while not conn.status:
                await conn.wait(self.read_timeout_s)
        except BaseException:
            conn.close()
            raise
        finally:
            if held is not None:
                held.discard(conn)
        return UpstreamResponse(self, key, conn, self.read_timeout_s, self.stall_timeout_s)

    def _take(self, key: tuple[str, int, bool]) -> tuple[UpstreamConnection | None, bool]:
        idle = self._idle.get(key)
        if not idle:
            return None, False
        now = time.monotonic()
        while idle:
            c = idle.pop()
            t = c.transport
            if (
                not c.closed
                and t is not None
                and not t.is_closing()
                and now - c.idle_since < self.idle_timeout_s
            ):
                return c, True
            c.close()
        return None, False

    def _release(self, key: tuple[str, int, bool], conn: UpstreamConnection) -> None:
        idle = self._idle.setdefault(key, [])
        if len(idle) >= self.max_idle_per_endpoint:
            conn.close()
            return
        conn.idle_since = time.monotonic()
        idle.append(conn)

    async def _connect(self, key: tuple[str, int, bool]) -> UpstreamConnection:
        host, port, tls = key
        loop = asyncio.get_running_loop()
        if tls and self._ssl is None:
            self._ssl = ssl.create_default_context()
        try:
            _, proto = await asyncio.wait_for(
                loop.create_connection(
                    lambda: UpstreamConnection(loop), host, port, ssl=self._ssl if tls else None
                ),
                self.connect_timeout_s,
            )
        except TimeoutError:
            raise ConnectFailed(
                f"connect to {host}:{port} timed out after {self.connect_timeout_s:g}s"
            ) from None
        except OSError as e:
            raise ConnectFailed(f"cannot connect to {host}:{port}: {e.strerror or e}") from None
        return proto

    def sweep(self) -> None:
        """Close connections idle for longer than ``idle_timeout_s`` (called once per tick)."""
        now = time.monotonic()
        for key, idle in list(self._idle.items()):
            keep = [c for c in idle if not c.closed and now - c.idle_since < self.idle_timeout_s]
            for c in idle:
                if c not in keep:
                    c.close()
            if keep:
                self._idle[key] = keep
            else:
                del self._idle[key]

    async def close(self) -> None:
        for idle in self._idle.values():
            for c in idle:
                c.close()
        self._idle.clear()
        # Let the transports finish closing inside the loop.
        await asyncio.sleep(0)
