"""Helpers for router tests that talk raw HTTP/1.1: bytes on the wire exactly as written."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from typing import Any


async def poll(cond: Callable[[], bool], timeout: float = 5.0) -> bool:
    """Wait until ``cond()`` holds (True) or ``timeout`` passes (its last value)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        await asyncio.sleep(0.01)
    return bool(cond())


class RawResponse:
    def __init__(self, status: int, headers: dict[str, str], body: bytes) -> None:
        self.status, self.headers, self.body = status, headers, body

    def json(self) -> Any:
        return json.loads(self.body)


async def read_response(reader: asyncio.StreamReader, timeout: float = 10.0) -> RawResponse:
    """One HTTP/1.1 response with a Content-Length (every answer the router makes itself has one)."""
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), timeout)
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    headers = {}
    for line in lines[1:]:
        if ":" in line:
            k, _, v = line.partition(":")
            headers[k.strip().lower()] = v.strip()
    n = int(headers.get("content-length", "0"))
    body = await asyncio.wait_for(reader.readexactly(n), timeout) if n else b""
    return RawResponse(status, headers, body)


async def raw_exchange(port: int, data: bytes, timeout: float = 10.0) -> RawResponse:
    """Send ``data`` as is on a new connection and read one response."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(data)
        await writer.drain()
        return await read_response(reader, timeout)
    finally:
        writer.close()
        await writer.wait_closed()


async def closed_by_peer(reader: asyncio.StreamReader, timeout: float) -> bytes:
    """Everything the peer sends until it closes the connection (raises TimeoutError if it does not)."""
    return await asyncio.wait_for(reader.read(), timeout)
