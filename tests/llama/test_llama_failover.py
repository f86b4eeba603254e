"""Mid-stream failover between two real llama.cpp servers: one is SIGKILLed while it streams.

Two ``llama-server`` processes on the same GGUF behind a static router (processes, as deployed). A
greedy (temperature 0) stream is started through the router; once some text has arrived, the server
holding it is killed. The router continues the stream on the other server (llama.cpp continues a final
assistant message; a completion continues prompt + text), and the client sees one whole answer: one id,
one finish_reason, one [DONE], text that begins with what it had before the kill and agrees with the
uninterrupted answer (asked of the surviving server directly) over their common length. Re-tokenizing the
text so far can move the length cut by a token, so the two may differ in length, not in content.

Skipped, with how to enable it, where ``make llama`` has not installed the server and the model.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest
import yaml

from tests.http_clients import async_client
from tests.kit.poll import eventually_sync
from tests.llama.llama_kit import (
    ENABLE_HINT,
    Service,
    clean_env,
    find_gguf,
    find_llama_server,
    free_port,
    start_service,
)

pytestmark = [pytest.mark.e2e, pytest.mark.xdist_group("llama"), pytest.mark.timeout(420)]

MODEL = "gemma-3-270m"
READY_TIMEOUT_S = 240.0
TOKENS = 48
ENGINE_ARGS = ["--threads", "1", "--ctx-size", "2048", "--parallel", "2"]


@pytest.fixture
def llama_pair(tmp_path: Path) -> Iterator[list[tuple[subprocess.Popen[bytes], str]]]:
    server, why = find_llama_server()
    if server is None:
        pytest.skip(f"no llama-server ({why}): {ENABLE_HINT}")
    gguf, why = find_gguf()
    if gguf is None:
        pytest.skip(f"no Gemma 3 270M GGUF ({why}): {ENABLE_HINT}")
    procs: list[tuple[subprocess.Popen[bytes], str]] = []
    try:
        for i in range(2):
            port = free_port()
            with (tmp_path / f"llama-{i}.log").open("wb") as log:
                p = subprocess.Popen(
                    [str(server), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port), *ENGINE_ARGS],
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                    start_new_session=True,
                )
            procs.append((p, f"http://127.0.0.1:{port}"))
        yield procs
    finally:
        for p, _ in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
            p.wait()


@pytest.fixture
def router(
    tmp_path: Path, llama_pair: list[tuple[subprocess.Popen[bytes], str]]
) -> Iterator[tuple[str, Service]]:
    static = tmp_path / "static.yaml"
    static.write_text(yaml.safe_dump({"models": [{"name": MODEL, "endpoints": [u for _, u in llama_pair]}]}))
    port = free_port()
    svc = start_service(
        "router", ["router", "--static", str(static), "--port", str(port), "--no-auth"], tmp_path, clean_env()
    )
    yield f"http://127.0.0.1:{port}", svc
    svc.stop()


def _answers(url: str) -> bool:
    try:
        return httpx.get(url, timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def _wait_ready(urls: list[str], timeout: float) -> None:
    eventually_sync(
        lambda: all(_answers(u) for u in urls),
        timeout=timeout,
        every=0.3,
        what=f"all of {urls} to answer 200",
    )


def _body(kind: str) -> tuple[str, dict[str, Any]]:
    common: dict[str, Any] = {"model": MODEL, "max_tokens": TOKENS, "temperature": 0, "stream": True}
    common["stream_options"] = {"include_usage": True}
    if kind == "chat":
        msgs = [{"role": "user", "content": "Write a short story about a lighthouse keeper."}]
        return "/v1/chat/completions", {**common, "messages": msgs}
    return "/v1/completions", {**common, "prompt": "The history of the city of Rome"}


def _piece(kind: str, event: dict[str, Any]) -> str:
    out = ""
    for c in event.get("choices") or ():
        out += (c.get("delta") or {}).get("content") or "" if kind == "chat" else c.get("text") or ""
    return out


async def _read(
    url: str,
    body: dict[str, Any],
    kind: str,
    on_piece: Callable[[int, list[Any]], Awaitable[None]] | None = None,
) -> list[Any]:
    events: list[Any] = []
    pieces = 0
    async with (
        async_client(timeout=120) as http,
        http.stream("POST", url, json=body) as r,
    ):
        assert r.status_code == 200, (await r.aread())[:300]
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                events.append("[DONE]")
                continue
            ev: dict[str, Any] = json.loads(line[6:])
            events.append(ev)
            if _piece(kind, ev):
                pieces += 1
                if on_piece is not None:
                    await on_piece(pieces, events)
    return events


def _holder(procs: list[tuple[subprocess.Popen[bytes], str]]) -> subprocess.Popen[bytes] | None:
    """The llama-server with an established client connection (the router's, for our one stream)."""
    for p, _ in procs:
        conns = psutil.Process(p.pid).net_connections("tcp")
        if any(c.status == psutil.CONN_ESTABLISHED and c.raddr for c in conns):
            return p
    return None


@pytest.mark.parametrize("kind", ["chat", "text"])
async def test_stream_continues_on_the_other_llama_server(
    kind: str, llama_pair: list[tuple[subprocess.Popen[bytes], str]], router: tuple[str, Service]
) -> None:
    base, svc = router
    await asyncio.to_thread(
        _wait_ready, [u + "/health" for _, u in llama_pair] + [base + "/health"], READY_TIMEOUT_S
    )
    path, body = _body(kind)
    before: list[str] = []
    killed: list[subprocess.Popen[bytes]] = []

    async def kill_after_some(pieces: int, events: list[Any]) -> None:
        if pieces == 8 and not killed:
            holder = _holder(llama_pair)
            assert holder is not None, "no llama-server holds the stream"
            os.killpg(holder.pid, signal.SIGKILL)
            killed.append(holder)
            before.append("".join(_piece(kind, e) for e in events if e != "[DONE]"))

    events = await _read(base + path, body, kind, kill_after_some)
    assert killed, "the stream ended before 8 pieces arrived"
    survivor = next(u for p, u in llama_pair if p is not killed[0])
    reference = await _read(survivor + path, body, kind)

    log = svc.tail(200)
    assert events.count("[DONE]") == 1 and events[-1] == "[DONE]", log
    chunks = [e for e in events if e != "[DONE]"]
    # One id and model (llama.cpp stamps each chunk's "created" with its own clock, so that moves anyway).
    assert len({(c["id"], c["model"]) for c in chunks}) == 1
    finishes = [c["finish_reason"] for e in chunks for c in e.get("choices") or () if c.get("finish_reason")]
    assert len(finishes) == 1, finishes
    text = "".join(_piece(kind, e) for e in chunks)
    ref = "".join(_piece(kind, e) for e in reference if e != "[DONE]")
    # What was delivered before the kill is kept, whole and once, and the answer goes on past it.
    assert text.startswith(before[0]) and len(text) > len(before[0])
    assert text[: len(before[0])] == ref[: len(before[0])], f"spliced {text!r}\nuninterrupted {ref!r}"
    # Past the cut a real model re-reads the delivered text as tokens, and a greedy answer may take
    # another path (a CI run: the small model had written "<|im_start|>", which the continuation read as
    # the special token and answered "assistant" after it). Exact equality past the cut is the sim
    # engine's to prove (tests/chaos/test_chaos_node_loss.py); here it is reported.
    common = min(len(text), len(ref))
    same = text[:common] == ref[:common]
    print(
        f"{kind}: continuation {'equals' if same else 'differs from'} the uninterrupted answer past the cut"
    )
    assert "continuing on" in log, log
    usage = chunks[-1].get("usage")
    ref_usage = reference[-2].get("usage")
    print(f"{kind}: spliced usage {usage}, uninterrupted {ref_usage}; text {len(text)} chars vs {len(ref)}")
    assert usage is not None and ref_usage is not None
    # Prompt tokens are the first request's: the continuation's less the tokens already sent.
    assert abs(usage["prompt_tokens"] - ref_usage["prompt_tokens"]) <= 2, (usage, ref_usage)
    if same:
        assert abs(usage["completion_tokens"] - ref_usage["completion_tokens"]) <= 2, (usage, ref_usage)
