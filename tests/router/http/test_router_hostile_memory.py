"""What one unauthenticated connection can make the router hold: pipelined floods, a huge trailer.

The router runs as its own process (``llmgw router --static``), so its memory is its own, measured by
psutil; the client is a raw socket that writes as fast as the router takes bytes and reads nothing.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import psutil
import pytest
import yaml

from llmgw_runtime.apikeys import hash_key
from tests.router.router_helpers import PortFactory, wait_serving

KEY = "llmgw-hostile-memory-test-key-8sKq2WmZ0pLx4VbN7cR1tY5uE3oH6jD9"
MB = 1024 * 1024
# The most one such connection may add to the router's resident memory.
BOUND = 16 * MB


class RouterProc:
    def __init__(self, proc: asyncio.subprocess.Process, port: int) -> None:
        self.proc, self.port = proc, port
        self.ps = psutil.Process(proc.pid)

    def rss(self) -> int:
        return int(self.ps.memory_info().rss)

    def cpu(self) -> float:
        t = self.ps.cpu_times()
        return float(t.user + t.system)


@pytest.fixture
async def router_proc(tmp_path: Path, port: PortFactory) -> AsyncIterator[RouterProc]:
    static = tmp_path / "static.yaml"
    # Auth on; the endpoint is never reached (nothing here is authenticated).
    static.write_text(
        yaml.safe_dump(
            {
                "keys": [{"name": "k", "hash": hash_key(KEY)}],
                "models": [{"name": "m1", "endpoints": ["http://127.0.0.1:9"]}],
            }
        )
    )
    p = port()
    proc = await asyncio.create_subprocess_exec(
        *(sys.executable, "-m", "llmgw_cli", "router", "--static", str(static), "--port", str(p)),
        start_new_session=True,
        stderr=asyncio.subprocess.DEVNULL,
    )
    try:
        await wait_serving(f"http://127.0.0.1:{p}/health", proc, timeout=30.0)
        yield RouterProc(proc, p)
    finally:
        if proc.returncode is None:
            os.killpg(proc.pid, signal.SIGKILL)
            await proc.wait()


async def _flood(port: int, chunks: list[bytes], for_s: float) -> int:
    """Write ``chunks`` on one connection, reading nothing, for at most ``for_s``; the bytes taken."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(("127.0.0.1", port))
    sock.setblocking(False)
    loop = asyncio.get_running_loop()
    sent = 0
    end = loop.time() + for_s
    try:
        for chunk in chunks:
            view = memoryview(chunk)
            while view and loop.time() < end:
                try:
                    n = sock.send(view)
                except BlockingIOError:
                    await asyncio.sleep(0.01)
                    continue
                except OSError:  # the router closed the connection: what it took is what it took
                    return sent
                sent += n
                view = view[n:]
        await asyncio.sleep(max(0.0, end - loop.time()))
        return sent
    finally:
        sock.close()


async def _health_ms(port: int) -> float:
    async with aiohttp.ClientSession() as s:
        t = time.perf_counter()
        async with s.get(f"http://127.0.0.1:{port}/health") as r:
            assert r.status == 200
        return (time.perf_counter() - t) * 1000


async def _peak_during(r: RouterProc, work: asyncio.Task[int]) -> int:
    peak = r.rss()
    while not work.done():
        peak = max(peak, r.rss())
        await asyncio.sleep(0.05)
    return peak


@pytest.mark.slow
async def test_a_pipelined_flood_from_a_client_that_reads_nothing_stays_bounded(
    router_proc: RouterProc,
) -> None:
    # 12 MiB of GET /health, then fifteen 8 MiB POSTs without a key, never reading an answer. Before:
    # every read was parsed whole and reading resumed after each answer: +245 MB for the GETs, and the
    # POSTs queued behind took their whole bodies before any key check (112-120 MB).
    r = router_proc
    base = r.rss()
    gets = b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n" * (12 * MB // 33)
    post = b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % (8 * MB)
    chunks = [gets] + [post, b"x" * (8 * MB)] * 15
    work = asyncio.create_task(_flood(r.port, chunks, 4.0))
    peak = await _peak_during(r, work)
    sent = work.result()
    print(f"pipelined flood: router +{(peak - base) / MB:.1f} MB, {sent / MB:.1f} MB taken")
    assert peak - base < BOUND, (f"router grew {(peak - base) / MB:.1f} MB", f"{sent / MB:.1f} MB sent")
    assert await _health_ms(r.port) < 2000


@pytest.mark.slow
async def test_a_huge_trailer_is_refused_before_it_grows_the_router(router_proc: RouterProc) -> None:
    # A chunked body of one byte and a 69 MiB trailer field, without a key. httptools joins a field's
    # pieces with a copy per read: +126 MB and 4.6 s of CPU, and /health elsewhere stalled for 4 s.
    r = router_proc
    base, cpu0 = r.rss(), r.cpu()
    head = b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n1\r\na\r\n0\r\nX-T: "
    work = asyncio.create_task(_flood(r.port, [head, b"a" * (69 * MB), b"\r\n\r\n"], 4.0))
    worst, peak = 0.0, base
    while not work.done():
        worst = max(worst, await _health_ms(r.port))
        peak = max(peak, r.rss())
        await asyncio.sleep(0.05)
    work.result()
    print(
        f"trailer: router +{(peak - base) / MB:.1f} MB, {r.cpu() - cpu0:.2f} s CPU, /health worst {worst:.0f} ms"
    )
    assert peak - base < BOUND, f"router grew {(peak - base) / MB:.1f} MB"
    assert r.cpu() - cpu0 < 1.0 and worst < 1000, (r.cpu() - cpu0, worst)


@pytest.mark.slow
async def test_a_body_in_tiny_chunks_after_a_refusal_is_not_kept(router_proc: RouterProc) -> None:
    # Refused (no key) at its head, the request's body went on into its buffer while the connection
    # lingered: up to max_body_bytes, and as one object per chunk (about 33 bytes of overhead for each
    # one-byte chunk), 8 MiB in one-byte chunks would be ~270 MB.
    r = router_proc
    base = r.rss()
    head = b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
    work = asyncio.create_task(_flood(r.port, [head, b"1\r\nx\r\n" * (4 * MB)], 4.0))
    peak = await _peak_during(r, work)
    sent = work.result()
    print(f"tiny chunks: router +{(peak - base) / MB:.1f} MB, {sent / MB:.1f} MB taken")
    assert peak - base < BOUND, f"router grew {(peak - base) / MB:.1f} MB"


@pytest.mark.slow
async def test_heads_of_many_tiny_fields_stay_bounded(router_proc: RouterProc) -> None:
    # 64 KB of "a:b" fields is 13,000 of them, ~130 bytes each as Python objects: 1.7 MB per head, and
    # as many heads as one read holds (or more, read after read, before any limit on the count).
    r = router_proc
    base = r.rss()
    head = b"GET /health HTTP/1.1\r\nHost: x\r\n" + b"a:b\r\n" * 12_000 + b"\r\n"
    work = asyncio.create_task(_flood(r.port, [head * 64], 4.0))
    peak = await _peak_during(r, work)
    print(f"tiny fields: router +{(peak - base) / MB:.1f} MB")
    assert peak - base < BOUND / 4, f"router grew {(peak - base) / MB:.1f} MB"
