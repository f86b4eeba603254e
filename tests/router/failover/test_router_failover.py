"""Mid-stream failover through a real router: an engine process SIGKILLed while it streams.

Two simulated engines as processes, a static router in-process, streaming clients. Every stream the
killed engine was serving is continued on the other one: the client sees each answer whole, exactly the
uninterrupted text (the simulator's answer continued from any point is the rest of it), one id, one
finish_reason, one [DONE], and usage that adds up.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any

import aiohttp
import pytest

from llmgw_router.service import Router
from llmgw_sim import openai_api as oai
from llmgw_sim.answers import answer_words
from llmgw_sim.openai_bodies import ChunkWriter
from llmgw_sim.options import SimOptions
from tests.kit.poll import eventually
from tests.router.router_helpers import (
    EngineFactory,
    EngineProcs,
    RouterFactory,
    StaticFile,
    start_engine_process,
    stop_engine_processes,
)

pytestmark = pytest.mark.slow

TOKENS = 120


@pytest.fixture
def engine_procs() -> Iterator[EngineProcs]:
    """Two sim engines as processes, each in its own session; 100 tokens/s."""
    procs: list[tuple[subprocess.Popen[bytes], str]] = []
    try:
        for _ in range(2):
            opts = SimOptions(port=0, model="m1", ttft_ms=20, tokens_per_s=100, slots=64)
            procs.append(start_engine_process("m1", opts))
        yield procs
    finally:
        stop_engine_processes(procs)


def _body(i: int) -> tuple[str, dict[str, Any]]:
    words = f"w{i} alpha beta gamma"
    if i % 4 == 3:
        return "/v1/completions", {"model": "m1", "prompt": words, "max_tokens": TOKENS, "stream": True}
    body: dict[str, Any] = {
        "model": "m1",
        "messages": [{"role": "user", "content": words}],
        "max_tokens": TOKENS,
        "stream": True,
    }
    if i % 2:
        body["stream_options"] = {"include_usage": True}
    return "/v1/chat/completions", body


def _expected(path: str, body: dict[str, Any]) -> tuple[str, tuple[int, int]]:
    read = oai.read_chat if path.endswith("chat/completions") else oai.read_completion
    g = read(body, 16)
    tokens = oai.completion_tokens(g)
    return "".join(tokens), (g.prompt_tokens, len(tokens))


async def _stream(s: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> tuple[int, list[Any]]:
    async with s.post(url, json=body) as r:
        raw = await r.read()
    events: list[Any] = []
    for e in raw.split(b"\n\n"):
        if e:
            payload = e.removeprefix(b"data: ")
            events.append("[DONE]" if payload == b"[DONE]" else json.loads(payload))
    return r.status, events


def _check(path: str, body: dict[str, Any], status: int, events: list[Any]) -> str:
    """What is wrong with a stream the client received ("" when nothing)."""
    if status != 200:
        return f"HTTP {status}"
    if events.count("[DONE]") != 1 or events[-1] != "[DONE]":
        return f"{events.count('[DONE]')} [DONE], last {str(events[-1])[:80]}"
    chunks = events[:-1]
    if len({(c["id"], c["created"], c["model"]) for c in chunks}) != 1:
        return "several ids"
    key = "delta" if "chat" in path else None
    text = "".join(
        (ch["delta"].get("content") or "") if key else ch["text"] for c in chunks for ch in c["choices"]
    )
    finishes = [ch["finish_reason"] for c in chunks for ch in c["choices"] if ch["finish_reason"]]
    want_text, want_usage = _expected(path, body)
    if text != want_text:
        return f"text differs: {len(text)} chars vs {len(want_text)}: {text[:80]!r}"
    if finishes != ["length"]:
        return f"finishes {finishes}"
    if "stream_options" in body:
        u = chunks[-1].get("usage") or {}
        if (u.get("prompt_tokens"), u.get("completion_tokens")) != want_usage:
            return f"usage {u} vs {want_usage}"
    return ""


async def _kill_one_mid_stream(
    routers: RouterFactory, static_file: StaticFile, engine_procs: EngineProcs, **model: Any
) -> tuple[Router, list[str]]:
    static = static_file({"m1": [u for _, u in engine_procs]}, auth=False)
    static["models"][0].update(model)
    r = await routers(static)
    base = f"http://127.0.0.1:{r.port}"
    victim = engine_procs[0][1]
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as s:
        bodies = [_body(i) for i in range(8)]
        tasks = [asyncio.create_task(_stream(s, base + p, b)) for p, b in bodies]

        def on_victim() -> int:
            return sum(e.in_flight for e in r.ctx.pool.by_key.values() if e.url == victim)

        await eventually(lambda: on_victim() >= 2, timeout=10.0, what="a stream to go to the victim")
        await asyncio.sleep(0.4)  # tokens flow
        os.killpg(engine_procs[0][0].pid, signal.SIGKILL)
        results = await asyncio.gather(*tasks)
    problems = [_check(p, b, st, ev) for (p, b), (st, ev) in zip(bodies, results, strict=True)]
    return r, problems


async def test_streams_on_a_killed_engine_are_continued_whole(
    routers: RouterFactory, static_file: StaticFile, engine_procs: EngineProcs
) -> None:
    r, problems = await _kill_one_mid_stream(routers, static_file, engine_procs)
    assert problems == [""] * 8, problems
    ok = r.ctx.metrics.migrations_count("m1", "ok")
    assert ok >= 2, ok
    assert r.ctx.metrics.migrations_count("m1", "failed") == 0
    await eventually(
        lambda: r.ctx.metrics.in_flight == 0 and all(e.in_flight == 0 for e in r.ctx.pool.by_key.values()),
        timeout=5.0,
        what="no request to be in flight at the router or any endpoint",
    )
    assert b'llmgw_router_migrations_total{model="m1",outcome="ok"}' in r.ctx.metrics.exposition()


async def test_with_failover_off_the_streams_are_cut(
    routers: RouterFactory, static_file: StaticFile, engine_procs: EngineProcs
) -> None:
    r, problems = await _kill_one_mid_stream(routers, static_file, engine_procs, failover=False)
    cut = [p for p in problems if p]
    assert cut and all("[DONE]" in p for p in cut), problems
    assert r.ctx.metrics.migrations_count("m1", "off") == len(cut)
    assert r.ctx.metrics.migrations_count("m1", "ok") == 0


# ---------------------------------------------------------------- engines that fail on purpose

# What a faulty engine does with a request: its writer and the request's JSON body.
Handler = Callable[[asyncio.StreamWriter, dict[str, Any]], Awaitable[None]]


class Faulty:
    """Raw HTTP servers that misbehave on purpose, all ended with the test.

    A handler that should hang on awaits :meth:`stall` (not a long sleep): :meth:`close` ends it, and
    every other handler still running, before the test's loop closes. A handler left to the loop's
    close is cancelled there, and asyncio's stream server then logs "Exception in callback" for it.
    """

    def __init__(self) -> None:
        self._ended = asyncio.Event()
        self._servers: list[asyncio.Server] = []
        self._handlers: set[asyncio.Task[Any]] = set()
        self._writers: list[asyncio.StreamWriter] = []

    async def start(self, handler: Handler) -> tuple[str, list[int]]:
        """A server that reads one request and runs ``handler(writer, body)``; its URL, and a count of
        the requests it read."""
        seen: list[int] = []

        async def serve(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
            task = asyncio.current_task()
            assert task is not None
            self._handlers.add(task)
            self._writers.append(w)
            try:
                head = await r.readuntil(b"\r\n\r\n")
                n = next(
                    int(x.split(b":")[1])
                    for x in head.split(b"\r\n")
                    if x.lower().startswith(b"content-length")
                )
                body = json.loads(await r.readexactly(n))
                seen.append(1)
                await handler(w, body)
            except (ConnectionError, asyncio.IncompleteReadError):
                pass
            finally:
                w.close()

        srv = await asyncio.start_server(serve, "127.0.0.1", 0)
        self._servers.append(srv)
        return f"http://127.0.0.1:{srv.sockets[0].getsockname()[1]}", seen

    async def stall(self) -> None:
        """Hold a handler (an engine that says nothing more) until the test ends."""
        await self._ended.wait()

    async def close(self) -> None:
        self._ended.set()
        for srv in self._servers:
            srv.close()
        # A handler may be blocked writing to a router that reads no more: the test is over, and
        # nothing it would send matters now.
        for w in self._writers:
            w.transport.abort()
        if self._handlers:
            _, pending = await asyncio.wait(self._handlers, timeout=5.0)
            assert not pending, f"fake engine handlers still running: {pending}"
        for srv in self._servers:
            await srv.wait_closed()


@pytest.fixture
async def faulty() -> AsyncIterator[Faulty]:
    f = Faulty()
    try:
        yield f
    finally:
        await f.close()


def _sim_stream(path: str, body: dict[str, Any]) -> bytes:
    read = oai.read_chat if path.endswith("chat/completions") else oai.read_completion
    g = read(body, 16)
    w = ChunkWriter("chatcmpl-faulty", 7, g, path.endswith("chat/completions"))
    tokens = oai.completion_tokens(g)
    return (w.first() + "".join(map(w.token, tokens)) + w.end(len(tokens))).encode()


async def test_answer_cut_short_is_retried_on_another_endpoint(
    engines: EngineFactory, routers: RouterFactory, static_file: StaticFile, faulty: Faulty
) -> None:
    async def half_a_body(w: asyncio.StreamWriter, body: dict[str, Any]) -> None:
        w.write(
            b'HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 400\r\n\r\n{"id": "x", '
        )
        await w.drain()

    bad, seen = await faulty.start(half_a_body)
    good = await engines("m1")
    r = await routers(static_file({"m1": [bad, good.url]}, auth=False))
    body = {"model": "m1", "messages": [{"role": "user", "content": "a b"}], "max_tokens": 3}
    async with aiohttp.ClientSession() as s:
        for _ in range(12):
            async with s.post(f"http://127.0.0.1:{r.port}/v1/chat/completions", json=body) as resp:
                assert resp.status == 200
                assert (await resp.json())["choices"][0]["message"]["content"] == " ".join(
                    answer_words(["a", "b"], "", 0, 3)
                )
    assert seen, "the faulty endpoint was never chosen"
    assert r.ctx.metrics.retries_count("m1") >= 1


@pytest.mark.parametrize("fault", ["closed-mid-event", "stalled"])
@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
async def test_stream_cut_or_stalled_is_continued(
    engines: EngineFactory,
    routers: RouterFactory,
    static_file: StaticFile,
    faulty: Faulty,
    fault: str,
    path: str,
) -> None:
    async def part_of_a_stream(w: asyncio.StreamWriter, body: dict[str, Any]) -> None:
        whole = _sim_stream(path, body)
        w.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n")
        part = whole[: len(whole) // 2 + 11]  # ends inside an event
        w.write(f"{len(part):x}\r\n".encode() + part + b"\r\n")
        await w.drain()
        if fault == "stalled":
            await faulty.stall()

    bad, seen = await faulty.start(part_of_a_stream)
    good = await engines("m1")
    r = await routers(static_file({"m1": [bad, good.url]}, auth=False), read_timeout_s=0.5)
    # The faulty endpoint is chosen first: the good one looks loaded.
    ep_good = next(e for e in r.ctx.pool.by_key.values() if e.url == good.url)
    ep_good.in_flight += 100  # the lighter endpoint wins the choice
    _, body = _body(1 if path.endswith("chat/completions") else 3)
    async with aiohttp.ClientSession() as s:
        status, events = await _stream(s, f"http://127.0.0.1:{r.port}{path}", body)
    ep_good.in_flight -= 100
    assert seen == [1]
    assert _check(path, body, status, events) == ""
    assert r.ctx.metrics.migrations_count("m1", "ok") == 1


async def test_the_broken_endpoint_is_marked_failed_while_its_stream_is_continued(
    engines: EngineFactory, routers: RouterFactory, static_file: StaticFile, faulty: Faulty
) -> None:
    path = "/v1/chat/completions"

    async def part_of_a_stream(w: asyncio.StreamWriter, body: dict[str, Any]) -> None:
        whole = _sim_stream(path, body)
        w.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n")
        part = whole[: len(whole) // 4]
        w.write(f"{len(part):x}\r\n".encode() + part + b"\r\n")
        await w.drain()

    bad, _ = await faulty.start(part_of_a_stream)
    good = await engines("m1", ttft_ms=10, tokens_per_s=40)  # the continuation takes seconds
    r = await routers(static_file({"m1": [bad, good.url]}, auth=False))
    ep_bad = next(e for e in r.ctx.pool.by_key.values() if e.url == bad)
    ep_good = next(e for e in r.ctx.pool.by_key.values() if e.url == good.url)
    ep_good.in_flight += 100
    _, body = _body(0)
    async with aiohttp.ClientSession() as s:
        task = asyncio.create_task(_stream(s, f"http://127.0.0.1:{r.port}{path}", body))
        await eventually(
            lambda: r.ctx.metrics.migrations_count("m1", "ok") == 0 and ep_good.in_flight == 101,
            timeout=10.0,
            what="the stream to be continued on the good endpoint without a counted migration",
        )
        ep_good.in_flight -= 100
        # The continuation is still streaming, and the breaker has heard of the failure already.
        assert ep_bad.breaker.failures == 1 and not task.done()
        status, events = await task
    assert _check(path, body, status, events) == ""
    assert ep_bad.breaker.failures == 1


# ---------------------------------------------------------------- continuations that misbehave

_PATH = "/v1/chat/completions"
_HEAD = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"


def _chunked(data: bytes) -> bytes:
    return f"{len(data):x}\r\n".encode() + data + b"\r\n"


async def _break_then(faulty: Faulty, continuation: Handler) -> str:
    """An engine that breaks every original stream half way and answers a continuation with ``continuation``."""

    async def handler(w: asyncio.StreamWriter, body: dict[str, Any]) -> None:
        w.write(_HEAD)
        if body.get("continue_final_message"):
            await continuation(w, body)
            return
        whole = _sim_stream(_PATH, body)
        w.write(_chunked(whole[: len(whole) // 2 + 11]))  # ends inside an event
        await w.drain()

    url, _ = await faulty.start(handler)
    return url


async def test_a_continuation_that_sends_two_done_and_stays_open_ends_the_stream_once(
    routers: RouterFactory, static_file: StaticFile, faulty: Faulty
) -> None:
    async def rest_twice_done_then_stall(w: asyncio.StreamWriter, body: dict[str, Any]) -> None:
        rest = _sim_stream(_PATH, body)
        w.write(_chunked(rest + b"data: [DONE]\n\n" + rest[: rest.index(b"\n\n") + 2]))
        await w.drain()
        await faulty.stall()  # never closes: the stream already ended at its [DONE]

    a = await _break_then(faulty, rest_twice_done_then_stall)
    b = await _break_then(faulty, rest_twice_done_then_stall)
    r = await routers(static_file({"m1": [a, b]}, auth=False), read_timeout_s=20)
    _, body = _body(0)
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    async with aiohttp.ClientSession() as s:
        status, events = await asyncio.wait_for(_stream(s, f"http://127.0.0.1:{r.port}{_PATH}", body), 15)
    assert _check(_PATH, body, status, events) == ""
    # Ended at the continuation's [DONE], not when the read timeout gave up on the silent engine.
    assert loop.time() - t0 < 10
    assert r.ctx.metrics.migrations_count("m1", "ok") == 1


async def test_a_continuation_without_event_separators_ends_the_stream_not_the_router(
    routers: RouterFactory, static_file: StaticFile, faulty: Faulty
) -> None:
    async def megabytes_without_blank_lines(w: asyncio.StreamWriter, body: dict[str, Any]) -> None:
        for _ in range(64):
            w.write(_chunked(b"data: " + b"x" * 16 * 1024 + b"\n"))
            await w.drain()
        await faulty.stall()

    a = await _break_then(faulty, megabytes_without_blank_lines)
    b = await _break_then(faulty, megabytes_without_blank_lines)
    r = await routers(static_file({"m1": [a, b]}, auth=False), read_timeout_s=20)
    _, body = _body(0)
    async with aiohttp.ClientSession() as s:
        async with s.post(f"http://127.0.0.1:{r.port}{_PATH}", json=body) as resp:
            assert resp.status == 200
            raw = await asyncio.wait_for(resp.content.read(), 15)
    # The client has the whole events of the first stream, none of the garbage, and no [DONE].
    assert b"xxxx" not in raw and b"[DONE]" not in raw and raw.endswith(b"\n\n")
    assert r.ctx.metrics.migrations_count("m1", "unsupported") == 1
    # The router still serves.
    async with aiohttp.ClientSession() as s:
        async with s.get(f"http://127.0.0.1:{r.port}/v1/models") as resp:
            assert resp.status == 200
