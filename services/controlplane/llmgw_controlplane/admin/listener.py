"""The admin listener: binds loopback unless ``allow_public`` (then with a warning), serves an app with
uvicorn under the process's own signal handling, and closes what it opened."""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import socket
from collections.abc import Callable, Iterator

import uvicorn
from fastapi import FastAPI

from llmgw_common.errors import InvalidInput

LOOPBACK_NAMES = frozenset({"localhost"})


class AdminBindError(InvalidInput, RuntimeError):
    """The admin listener cannot bind as configured; the message says why and what to change."""


def is_loopback(host: str) -> bool:
    """True for ``localhost`` and loopback addresses; any other name is not (it is never resolved here)."""
    h = host.strip().strip("[]").lower()
    if h in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(h).is_loopback
    except ValueError:
        return False


class _Server(uvicorn.Server):
    """uvicorn, minus its signal handlers: the process's own handlers set ``stop`` (runtime.run_service)."""

    def __init__(self, config: uvicorn.Config) -> None:
        super().__init__(config)
        self.ready = asyncio.Event()

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        self.ready.set()


class AdminServer:
    """The admin listener: :meth:`start` binds (or raises :class:`AdminBindError`) and serves; :meth:`close`."""

    def __init__(self, app: FastAPI, host: str, port: int, allow_public: bool, log: logging.Logger) -> None:
        self.app = app
        self.host = host
        self.port = port
        self.allow_public = allow_public
        self.log = log
        self.bound_port: int | None = None
        self._server: _Server | None = None
        self._task: asyncio.Task[None] | None = None
        self._sock: socket.socket | None = None

    def _bind(self) -> socket.socket:
        if not is_loopback(self.host):
            if not self.allow_public:
                raise AdminBindError(
                    f"the admin listener would bind {self.host!r}, which is not loopback: it serves the console "
                    "and debug endpoints that can expose the control plane's memory. Bind 127.0.0.1 (and reach "
                    "it through an SSH tunnel), or set allow_public_admin (LLMGW_ALLOW_PUBLIC_ADMIN=1) to "
                    "serve it there anyway"
                )
            self.log.warning(
                "admin listener bound to %s, off loopback (allow_public_admin): it serves the console and "
                "debug endpoints that can expose the control plane's memory to anyone who can reach it",
                self.host,
            )
        try:
            infos = socket.getaddrinfo(
                self.host or None, self.port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
            )
        except socket.gaierror as e:
            raise AdminBindError(f"admin listener: cannot resolve {self.host!r}: {e.strerror}") from None
        family, kind, proto, _, addr = infos[0]
        sock = socket.socket(family, kind, proto)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(addr)
        except OSError as e:
            sock.close()
            raise AdminBindError(
                f"admin listener: cannot bind {self.host}:{self.port} ({e.strerror}); "
                "choose another --admin-port, or 0 for none"
            ) from None
        sock.setblocking(False)
        return sock

    async def start(self) -> int:
        """Bind and start serving; the bound port (the real one when asked for port 0)."""
        sock = self._sock = self._bind()
        config = uvicorn.Config(
            self.app,
            log_config=None,
            access_log=False,
            lifespan="off",
            proxy_headers=False,  # forwarded headers are never trusted (ARCHITECTURE #12)
            server_header=False,
            date_header=False,
            timeout_graceful_shutdown=2,
            ws="none",
        )
        server = self._server = _Server(config)
        self._task = asyncio.create_task(server.serve(sockets=[sock]), name="cp-admin")
        ready = asyncio.create_task(server.ready.wait())
        await asyncio.wait({self._task, ready}, return_when=asyncio.FIRST_COMPLETED)
        if not ready.done():
            ready.cancel()
            await self._task  # raises what the start raised
            raise AdminBindError("admin listener stopped while starting")
        self.bound_port = sock.getsockname()[1]
        self.log.info("console on http://%s/ (read-only)", _url_host(self.host, self.bound_port))
        return self.bound_port

    async def close(self) -> None:
        server, task = self._server, self._task
        self._server = self._task = None
        if server is None or task is None:
            return
        server.should_exit = True
        await asyncio.wait({task})  # our own cancellation still propagates; the task's outcome does not
        if not task.cancelled() and (e := task.exception()) is not None:
            self.log.warning("admin listener ended with an error: %s", e)
        # A listener that died without its own shutdown leaves these open.
        for srv in getattr(server, "servers", ()):
            srv.close()
        if self._sock is not None:
            self._sock.close()
            self._sock = None


def _url_host(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


async def serve_admin(
    app: FastAPI,
    host: str,
    port: int,
    allow_public: bool,
    stop: asyncio.Event,
    log: logging.Logger,
    on_bound: Callable[[int], None] | None = None,
) -> None:
    """Serve ``app`` until ``stop`` is set. Raises :class:`AdminBindError` before serving when it cannot bind.

    ``on_bound`` receives the bound port (the real one for port 0) once the listener accepts connections.
    """
    server = AdminServer(app, host, port, allow_public, log)
    bound = await server.start()
    try:
        if on_bound is not None:
            on_bound(bound)
        await stop.wait()
    finally:
        await server.close()
