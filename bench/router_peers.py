"""llmgw's router against its peer vllm-router (Rust) and direct-to-engine, side by side on one engine.

Two benches, one script:

* the peer bench (issue 36, point 5): direct, ``llmgw router --static`` (auth on, one key) and
  ``vllm-router`` 0.1.17 (``--policy round_robin``), all in front of ONE ``llmgw sim-engine --zero``.
  Six cases: non-streamed and 16-chunk streamed chat at 1, 8 and 32 closed-loop clients, ``--seconds``
  per case and target, median of ``--repeats``, the targets interleaved case by case (the order reversed
  every repeat) so that whatever else loads the machine loads all of them alike. Per target and case:
  requests/s, share of direct's requests/s, CPU ms per request of the gateway's whole process tree,
  added p50/p99 against direct; then the ratios llmgw / vllm-router.
* ``--realistic`` (issue 36, point 3): llmgw's router, a bare aiohttp.web pass-through proxy (a
  well-kept server plus client, no gateway logic: what a swap's floor costs) and vllm-router in front
  of simulated engines with real timing (``--ttft-ms``, ``--tokens-per-s``, ``--tokens``-long streams),
  at a few numbers of open streams. Reports router cores per 1,000 requests/s and per 1,000 open
  streams, and router CPU per request as a share of the request's wall time (the issue's 1 % rule).

The load generator is one aiohttp client on uvloop with keep-alive; its own CPU use is measured, and a
run where it used most of a core is marked: there the generator, not the target, set the rate.

vllm-router is installed, when missing, into its own venv outside the repo (``PEER_VENV``); when that
fails the peer is skipped with the reason and the others still run.

    .venv/bin/python bench/router_peers.py                  # peer bench, 6 cases x 3 targets x 2 x 10 s
    .venv/bin/python bench/router_peers.py --quick          # about 1 minute, a smoke
    .venv/bin/python bench/router_peers.py --realistic      # point 3: 100, 400, 1,000 open streams
    .venv/bin/python bench/router_peers.py --realistic --quick

Importable by other benches: ``ensure_vllm_router``; ``spawn_vllm_router``, ``spawn_llmgw``,
``spawn_aiohttp_proxy`` (each returns a ``Gateway``; ``await up(gw)`` waits for its /health, and
``start_all`` does both, skipping with a reason what cannot start); ``Gateway.cpu_s`` (its process
tree's CPU seconds) and ``Gateway.stop``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import fcntl
import hashlib
import itertools
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import aiohttp
import psutil
from aiohttp import web

# The bench folder (its sibling scripts' helpers) and the repo root (tests.kit's one free-port helper).
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from tests.kit.ports import free_port

import router_ab
import router_overhead as ro

PEER_VENV = Path.home() / ".cache" / "llmgw" / "peers" / "venv"
VLLM_ROUTER_VERSION = "0.1.17"
MODEL = "bench"
CHAT = "/v1/chat/completions"
# A generator process that used this share of one core or more set the rate itself.
GEN_BOUND = 0.85
MESSAGES = [{"role": "user", "content": "hello"}]


class PeerUnavailable(RuntimeError):
    """The peer could not be installed or started; the message says why."""


# ---------------------------------------------------------------- CPU of a process tree


def tree_cpu_s(pid: int) -> float:
    """User + system seconds of ``pid`` and all its descendants, live and reaped."""
    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return 0.0
    total = 0.0
    for p in procs:
        with contextlib.suppress(psutil.Error):
            t = p.cpu_times()
            total += t.user + t.system + t.children_user + t.children_system
    return total


def machine_busy_s() -> tuple[float, float]:
    """(busy, total) CPU seconds of the whole machine so far, every core, every process."""
    t = psutil.cpu_times()
    total = sum(t)
    return total - t.idle - getattr(t, "iowait", 0.0), total


@dataclass
class Gateway:
    """A target: a base URL and the process (group) behind it; ``proc`` None for direct."""

    name: str
    base: str
    proc: subprocess.Popen[bytes] | None = None
    log: Path | None = None

    @property
    def chat_url(self) -> str:
        return self.base + CHAT

    def cpu_s(self) -> float:
        return tree_cpu_s(self.proc.pid) if self.proc else 0.0

    def stop(self) -> None:
        if self.proc:
            ro.stop(self.proc)

    def log_tail(self, lines: int = 15) -> str:
        if not self.log or not self.log.exists():
            return ""
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])


# ---------------------------------------------------------------- the peer: install and start


def installed_vllm_router(venv: Path = PEER_VENV) -> str | None:
    """The vllm-router version installed in ``venv`` (from its dist-info), or None."""
    for d in venv.glob("lib/python*/site-packages/vllm_router-*.dist-info"):
        if (venv / "bin" / "vllm-router").exists():
            return d.name.removeprefix("vllm_router-").removesuffix(".dist-info")
    return None


def ensure_vllm_router(venv: Path = PEER_VENV, version: str = VLLM_ROUTER_VERSION) -> Path:
    """The ``vllm-router`` executable at ``version``, installed into ``venv`` first when missing.

    A venv of its own: its dependencies (fastapi, uvicorn, ...) must not move the project's. Several
    benches may call this at once, so the install holds a lock beside the venv.
    """
    exe = venv / "bin" / "vllm-router"
    if installed_vllm_router(venv) == version:
        return exe
    try:
        _install_vllm_router(venv, version)
    except OSError as e:  # a venv folder that cannot be made or locked
        raise PeerUnavailable(f"cannot install into {venv}: {e}") from e
    if installed_vllm_router(venv) != version:
        raise PeerUnavailable(f"vllm-router {version} still not in {venv} after pip install")
    return exe


def _install_vllm_router(venv: Path, version: str) -> None:
    venv.parent.mkdir(parents=True, exist_ok=True)
    with open(venv.parent / ".vllm-router.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if installed_vllm_router(venv) == version:  # another bench installed it while we waited
            return
        print(f"installing vllm-router=={version} into {venv} (once) ...", file=sys.stderr, flush=True)
        py = venv / "bin" / "python"
        steps = [[sys.executable, "-m", "venv", str(venv)]] if not py.exists() else []
        steps.append([str(py), "-m", "pip", "install", "--quiet", f"vllm-router=={version}"])
        for cmd in steps:
            try:
                r = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
            except (OSError, subprocess.TimeoutExpired) as e:
                raise PeerUnavailable(f"{shlex.join(cmd)}: {e}") from e
            if r.returncode != 0:
                tail = (r.stderr or r.stdout).strip().splitlines()[-3:]
                raise PeerUnavailable(f"{shlex.join(cmd)} exited {r.returncode}: {' | '.join(tail)}")


async def up(gw: Gateway, timeout: float = 60.0) -> Gateway:
    """``gw`` once its /health answers 200; stopped, and an error with its log's tail, if not.

    A process that exits while starting (a work tree mid-edit, a port taken) fails at once, with its
    exit status, instead of after the whole timeout.
    """

    async def exited() -> int:
        while gw.proc is None or (code := gw.proc.poll()) is None:
            await asyncio.sleep(0.1)
        return code

    waiting = asyncio.create_task(ro.wait_http(gw.base + "/health", timeout))
    dying = asyncio.create_task(exited())
    try:
        await asyncio.wait([waiting, dying], return_when=asyncio.FIRST_COMPLETED)
    finally:
        for t in (waiting, dying):
            t.cancel()
    if dying.done() and not dying.cancelled():
        why = f"exited with status {dying.result()} while starting"
    elif waiting.done() and not waiting.cancelled() and waiting.exception() is None:
        return gw
    else:
        why = f"no 200 from /health in {timeout:g} s"
    gw.stop()
    raise PeerUnavailable(f"{gw.name} at {gw.base}: {why}\n{gw.log_tail()}".rstrip())


def spawn_vllm_router(
    endpoints: Sequence[str],
    logs: Path,
    policy: str = "round_robin",
    exe: Path | None = None,
    extra: Sequence[str] = (),
) -> Gateway:
    """vllm-router over ``endpoints`` on a free port (``await up(gw)`` before use).

    Flags that matter, read from its ``--help`` and its argument code: the default policy is
    cache_aware (a radix tree per request), so ask for round_robin; ``--prometheus-port`` defaults to
    29000 although the help says metrics are off unless given, so two routers at once would collide;
    the startup health poll waits 30 s between tries unless told otherwise.
    """
    exe = exe or ensure_vllm_router()
    port = free_port()
    log = logs / f"vllm-router-{port}.log"
    cmd = [
        str(exe),
        "--host", "127.0.0.1",
        "--port", str(port),
        "--worker-urls", *endpoints,
        "--policy", policy,
        "--prometheus-port", str(free_port()),
        "--worker-startup-check-interval", "1",
        "--log-level", "warning",
        *extra,
    ]  # fmt: skip
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    return Gateway("vllm-router", f"http://127.0.0.1:{port}", proc, log)


def write_static(directory: Path, endpoints: Sequence[str], model: str = MODEL, key: str = ro.KEY) -> Path:
    """A ``llmgw router --static`` file: one key, one model served by ``endpoints``."""
    h = hashlib.sha256(key.encode()).hexdigest()
    path = directory / "static.yaml"
    path.write_text(
        f"keys: [{{name: bench, hash: {h}}}]\n"
        f"models:\n  - {{name: {model}, endpoints: [{', '.join(endpoints)}]}}\n"
    )
    return path


def spawn_llmgw(
    endpoints: Sequence[str], workdir: Path, rev: str | None = None, static: Path | None = None
) -> Gateway:
    """``llmgw router --static`` over ``endpoints`` (auth on, key ``ro.KEY``), as router_overhead starts it.

    ``rev``: run that git revision's router (exported with router_ab.export_tree) instead of the work
    tree's, e.g. while the work tree is mid-change. ``static``: a static file of the caller's own
    (e.g. with cache routing) instead of ``write_static``'s.
    """
    pythonpath = router_ab.export_tree(rev, workdir / "llmgw-rev") if rev else None
    port = free_port()
    proc = ro.start_router(static or write_static(workdir, endpoints), port, pythonpath)
    return Gateway("llmgw" if not rev else f"llmgw@{rev}", f"http://127.0.0.1:{port}", proc)


def spawn_aiohttp_proxy(endpoints: Sequence[str]) -> Gateway:
    """The bare aiohttp.web pass-through below, as its own process, on a free port."""
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, str(Path(__file__).resolve()), "_aiohttp_proxy", str(port), *endpoints],
        start_new_session=True,
    )
    return Gateway("aiohttp.web", f"http://127.0.0.1:{port}", proc)


async def _serve_aiohttp_proxy(port: int, upstreams: list[str]) -> None:
    """POST /v1/chat/completions passed through, bytes untouched, round-robin over ``upstreams``.

    No auth, no routing, no usage: a well-kept server and client and nothing else, so its CPU per
    request is the floor of what llmgw would cost on aiohttp.web.
    """
    turn = itertools.cycle(upstreams)
    client = aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=60), auto_decompress=False
    )

    async def chat(req: web.Request) -> web.StreamResponse:
        body = await req.read()
        headers = {"Content-Type": req.headers.get("Content-Type", "application/json")}
        async with client.post(next(turn) + CHAT, data=body, headers=headers) as up:
            ctype = up.headers.get("Content-Type", "application/json")
            if not ctype.startswith("text/event-stream"):
                return web.Response(status=up.status, body=await up.read(), headers={"Content-Type": ctype})
            resp = web.StreamResponse(status=up.status, headers={"Content-Type": ctype})
            await resp.prepare(req)
            async for chunk in up.content.iter_any():
                await resp.write(chunk)
            await resp.write_eof()
            return resp

    async def health(_: web.Request) -> web.Response:
        return web.Response(text="ok")

    app = web.Application()
    app.router.add_post(CHAT, chat)
    app.router.add_get("/health", health)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        await asyncio.Event().wait()  # until SIGTERM
    finally:
        await client.close()
        await runner.cleanup()


# ---------------------------------------------------------------- load


def chat_body(tokens: int, stream: bool, model: str = MODEL) -> bytes:
    return json.dumps({"model": model, "messages": MESSAGES, "max_tokens": tokens, "stream": stream}).encode()


def pct(values: Sequence[float], q: float) -> float:
    if not values:
        return float("nan")
    v = sorted(values)
    return v[min(len(v) - 1, int(q * len(v)))]


@dataclass
class Tally:
    ok: int = 0
    errors: int = 0
    lat_ms: list[float] = field(default_factory=list)
    first_error: str = ""


async def request(s: aiohttp.ClientSession, url: str, body: bytes, stream: bool, tally: Tally) -> None:
    """One request, read to its end; counted good only with a 200 (and a stream's [DONE])."""
    t0 = time.perf_counter()
    try:
        async with s.post(url, data=body) as r:
            data = await r.read()
            status = r.status
    except (aiohttp.ClientError, TimeoutError) as e:
        tally.errors += 1
        tally.first_error = tally.first_error or f"{type(e).__name__}: {e}"
        return
    if status == 200 and (not stream or data.endswith(b"data: [DONE]\n\n")):
        tally.ok += 1
        tally.lat_ms.append((time.perf_counter() - t0) * 1000)
    else:
        tally.errors += 1
        tally.first_error = tally.first_error or f"HTTP {status}: {data[:200]!r}"


def session(timeout_s: float = ro.CLIENT_TIMEOUT_S) -> aiohttp.ClientSession:
    """The generator's one client: keep-alive held across the other targets' turns."""
    return aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=300),
        headers={"Authorization": f"Bearer {ro.KEY}", "Content-Type": "application/json"},
        timeout=aiohttp.ClientTimeout(total=timeout_s),
    )


@dataclass
class Sample:
    """One target's run: what the client saw and what each side spent."""

    ok: int
    errors: int
    seconds: float
    p50_ms: float
    p99_ms: float
    gateway_cpu_s: float
    engine_cpu_s: float
    generator_cpu_s: float
    machine_busy: float  # share of all the machine's cores busy (anyone's work)
    first_error: str = ""
    open_streams: float = 0.0  # mean requests in flight (the realistic bench)

    @property
    def rps(self) -> float:
        return self.ok / self.seconds if self.seconds else 0.0

    @property
    def gateway_ms_per_req(self) -> float:
        return self.gateway_cpu_s * 1000 / max(self.ok, 1)

    @property
    def engine_ms_per_req(self) -> float:
        return self.engine_cpu_s * 1000 / max(self.ok, 1)

    @property
    def generator_cores(self) -> float:
        return self.generator_cpu_s / self.seconds if self.seconds else 0.0


class Meter:
    """CPU of the gateway, the engines, this generator and the whole machine between start and stop."""

    def __init__(self, gw: Gateway, engines: Sequence[subprocess.Popen[bytes]]) -> None:
        self.gw, self.engines, self.me = gw, engines, psutil.Process()

    def read(self) -> tuple[float, float, float, float, float, float]:
        t = self.me.cpu_times()
        busy, total = machine_busy_s()
        return (
            time.perf_counter(),
            self.gw.cpu_s(),
            sum(tree_cpu_s(e.pid) for e in self.engines),
            t.user + t.system,
            busy,
            total,
        )

    def sample(self, start: tuple[float, ...], tally: Tally, open_streams: float = 0.0) -> Sample:
        end = self.read()
        d = [b - a for a, b in zip(start, end, strict=True)]
        return Sample(
            tally.ok,
            tally.errors,
            d[0],
            pct(tally.lat_ms, 0.50),
            pct(tally.lat_ms, 0.99),
            d[1],
            d[2],
            d[3],
            d[4] / d[5] if d[5] else 0.0,
            tally.first_error,
            open_streams,
        )


async def closed_loop(
    s: aiohttp.ClientSession,
    gw: Gateway,
    meter: Meter,
    body: bytes,
    stream: bool,
    clients: int,
    seconds: float,
) -> Sample:
    """``clients`` loops, each sending its next request when the last one ended, for ``seconds``."""
    tally = Tally()
    loop = asyncio.get_running_loop()
    end = loop.time() + seconds

    async def client() -> None:
        while loop.time() < end:
            await request(s, gw.chat_url, body, stream, tally)

    start = meter.read()
    await asyncio.gather(*(client() for _ in range(clients)))
    return meter.sample(start, tally)


# ---------------------------------------------------------------- the peer bench (point 5)


@dataclass(frozen=True)
class Case:
    stream: bool
    clients: int

    @property
    def name(self) -> str:
        kind = "16-chunk stream" if self.stream else "non-stream"
        return f"{kind}, {self.clients} client{'s' if self.clients > 1 else ''}"


def interleaved(names: Sequence[str], repeats: int) -> Iterator[tuple[int, str]]:
    """(repeat, target) in turn, the order reversed every repeat: no target always runs first."""
    for r in range(repeats):
        for name in names if r % 2 == 0 else reversed(names):
            yield r, name


async def start_all(
    spawners: Sequence[tuple[str, Callable[[], Gateway]]],
) -> tuple[list[Gateway], list[str]]:
    """Start every gateway, then wait for all; one that cannot start is skipped with its reason."""
    spawned: list[Gateway] = []
    skipped: list[str] = []
    for name, spawn in spawners:
        try:
            spawned.append(spawn())
        except PeerUnavailable as e:
            skipped.append(f"SKIP {name}: {e}")
    ready: list[Gateway] = []
    for gw, outcome in zip(
        spawned, await asyncio.gather(*(up(g) for g in spawned), return_exceptions=True), strict=True
    ):
        if isinstance(outcome, PeerUnavailable):
            skipped.append(f"SKIP {gw.name}: {outcome}")
        elif isinstance(outcome, BaseException):
            for g in spawned:
                g.stop()
            raise outcome
        else:
            ready.append(gw)
    for line in skipped:
        print(line, file=sys.stderr, flush=True)
    return ready, skipped


def _spawners(
    a: argparse.Namespace, urls: list[str], workdir: Path, with_aiohttp: bool
) -> list[tuple[str, Callable[[], Gateway]]]:
    """The gateways a run asks for, in the order they take turns."""
    out: list[tuple[str, Callable[[], Gateway]]] = [
        ("llmgw", lambda: spawn_llmgw(urls, workdir, a.llmgw_rev))
    ]
    if with_aiohttp:
        out.append(("aiohttp.web", lambda: spawn_aiohttp_proxy(urls)))
    if not a.no_peer:
        out.append(("vllm-router", lambda: spawn_vllm_router(urls, workdir, a.vllm_router_policy, _peer(a))))
    return out


def _median(samples: list[Sample], f: Callable[[Sample], float]) -> float:
    return statistics.median(f(x) for x in samples)


async def peer_bench(a: argparse.Namespace, workdir: Path) -> dict[str, object]:
    engine, engine_url = ro.start_engine("--zero", "--slots", "4096", model=MODEL)
    gateways: list[Gateway] = []
    try:
        gateways, skipped = await start_all(_spawners(a, [engine_url], workdir, a.with_aiohttp))
        targets = {g.name: g for g in [Gateway("direct", engine_url), *gateways]}
        cases = [Case(stream, c) for stream in (False, True) for c in a.clients]
        results: dict[str, dict[str, list[Sample]]] = {}
        async with session() as s:
            for g in targets.values():  # warm: pools, first-request costs
                await closed_loop(s, g, Meter(g, [engine]), chat_body(16, False), False, 8, 0.5)
            for case in cases:
                body = chat_body(16, case.stream)
                per: dict[str, list[Sample]] = {n: [] for n in targets}
                for _, name in interleaved(list(targets), a.repeats):
                    g = targets[name]
                    per[name].append(
                        await closed_loop(
                            s, g, Meter(g, [engine]), body, case.stream, case.clients, a.seconds
                        )
                    )
                results[case.name] = per
                print(_case_line(case.name, per), flush=True)
        return {"skipped": skipped, "results": results, "gateways": [g.name for g in gateways]}
    finally:
        for g in gateways:
            g.stop()
        ro.stop(engine)


def _case_line(name: str, per: dict[str, list[Sample]]) -> str:
    parts = []
    for t, xs in per.items():
        part = f"{t} {_median(xs, lambda x: x.rps):.0f}/s"
        if t != "direct":
            part += f" {_median(xs, lambda x: x.gateway_ms_per_req):.3f} ms CPU/req"
        errors = sum(x.errors for x in xs)
        if errors:
            part += f" {errors} ERRORS ({next(x.first_error for x in xs if x.first_error)})"
        parts.append(part)
    return f"  {name}: " + "; ".join(parts)


def peer_table(results: dict[str, dict[str, list[Sample]]], gateways: list[str]) -> str:
    """One markdown table, targets side by side per figure, and the llmgw / vllm-router ratios."""
    slash = " / ".join
    head = [
        "case",
        f"req/s direct / {slash(gateways)}",
        f"share of direct {slash(gateways)}",
        f"gateway CPU ms/req {slash(gateways)}",
        f"added p50 ms {slash(gateways)}",
        f"added p99 ms {slash(gateways)}",
        "engine CPU ms/req direct / " + slash(gateways),
        "generator on direct: cores; CPU per request / engine's",
        "machine busy",
    ]
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    notes: list[str] = []
    for case, per in results.items():
        med = {t: {k: _median(xs, f) for k, f in _FIGURES.items()} for t, xs in per.items()}
        d = med["direct"]
        gen_cores = max(x.generator_cores for x in per["direct"])
        # One process per side on 2 cores: the side that costs more per request saturates first.
        gen_vs_engine = _median(
            per["direct"], lambda x: x.generator_cpu_s / x.engine_cpu_s if x.engine_cpu_s else 0
        )
        gen_bound = gen_cores >= GEN_BOUND or gen_vs_engine >= 1.0
        busy = max(x.machine_busy for xs in per.values() for x in xs)
        if gen_bound:
            notes.append(case)
        row = [
            case,
            slash(f"{med[t]['rps']:.0f}" for t in ["direct", *gateways]),
            slash(f"{med[t]['rps'] / d['rps']:.2f}" if d["rps"] else "-" for t in gateways),
            slash(f"{med[t]['cpu']:.3f}" for t in gateways),
            slash(f"{med[t]['p50'] - d['p50']:+.2f}" for t in gateways),
            slash(f"{med[t]['p99'] - d['p99']:+.2f}" for t in gateways),
            slash(f"{med[t]['eng']:.3f}" for t in ["direct", *gateways]),
            f"{gen_cores:.2f}; {gen_vs_engine:.2f}{' GEN-BOUND' if gen_bound else ''}",
            f"{busy:.0%}",
        ]
        lines.append("| " + " | ".join(row) + " |")
    if notes:
        lines.append(
            f"\nGEN-BOUND ({', '.join(notes)}): on the direct runs the generator used >= {GEN_BOUND:.0%} of a "
            "core, or more CPU per request than the engine: direct's rate there is the generator's ceiling, "
            "not the engine's, and the shares are measured against that ceiling."
        )
    elif any(x.machine_busy > 0.9 for per in results.values() for xs in per.values() for x in xs):
        lines.append(
            "\nThe machine was over 90 % busy: rates and shares are the scheduler's as much as ours."
        )
    ours = next((g for g in gateways if g.startswith("llmgw")), None)
    if ours and "vllm-router" in gateways:
        lines.append(_ratio_table(results, ours, "vllm-router"))
    return "\n".join(lines)


_FIGURES: dict[str, Callable[[Sample], float]] = {
    "rps": lambda x: x.rps,
    "cpu": lambda x: x.gateway_ms_per_req,
    "eng": lambda x: x.engine_ms_per_req,
    "p50": lambda x: x.p50_ms,
    "p99": lambda x: x.p99_ms,
}


def _ratio_table(results: dict[str, dict[str, list[Sample]]], ours: str, peer: str) -> str:
    """Rate and CPU ratios; 'ahead' only where the CPU gap is wider than the repeats' own spread."""
    lines = [
        f"\n| case | req/s {ours} / {peer} | CPU ms/req {ours} / {peer} | CPU spread over repeats "
        f"{ours} / {peer} | added p99 ms {ours} / {peer} | {ours} ahead on rate and CPU |",
        "| --- | ---: | ---: | --- | --- | --- |",
    ]
    verdicts: list[str] = []
    for case, per in results.items():
        m = {t: {k: _median(per[t], f) for k, f in _FIGURES.items()} for t in ("direct", ours, peer)}
        rate = m[ours]["rps"] / m[peer]["rps"] if m[peer]["rps"] else float("nan")
        cpu = m[ours]["cpu"] / m[peer]["cpu"] if m[peer]["cpu"] else float("nan")
        spread = {t: _spread([x.gateway_ms_per_req for x in per[t]]) for t in (ours, peer)}
        noise = max(spread.values())
        if rate > 1 and cpu < 1:
            verdict = "yes" if 1 - cpu > noise else "yes, within noise"
        else:
            verdict = "no" if cpu - 1 > noise or rate < 1 else "no, within noise"
        verdicts.append(verdict)
        p99 = f"{m[ours]['p99'] - m['direct']['p99']:+.2f} / {m[peer]['p99'] - m['direct']['p99']:+.2f}"
        spreads = " / ".join(f"{spread[t]:.0%}" if len(per[t]) > 1 else "-" for t in (ours, peer))
        lines.append(f"| {case} | {rate:.2f} | {cpu:.2f} | {spreads} | {p99} | {verdict} |")
    ahead_all = all(v.startswith("yes") for v in verdicts)
    top = max(int(c.rsplit(", ", 1)[1].split()[0]) for c in results)  # the most clients asked for
    for case, per in results.items():
        if case.endswith(f", {top} clients"):
            added = _median(per[ours], _FIGURES["p99"]) - _median(per["direct"], _FIGURES["p99"])
            lines.append(f"added p99, {case}: {ours} {added:+.2f} ms (goal: under 5 ms)")
    lines.append(
        f"\n{ours} ahead of {peer} on rate and CPU in every case: {'yes' if ahead_all else 'no'}"
        f"{' (some within noise)' if any('noise' in v for v in verdicts) else ''}"
    )
    return "\n".join(lines)


def _spread(values: list[float]) -> float:
    """(max - min) / median: how far one repeat strays from another; 0 with one repeat."""
    med = statistics.median(values) if values else 0.0
    return (max(values) - min(values)) / med if len(values) > 1 and med else 0.0


# ---------------------------------------------------------------- realistic timing (point 3)


async def open_streams(
    s: aiohttp.ClientSession,
    gw: Gateway,
    meter: Meter,
    body: bytes,
    streams: int,
    ramp_s: float,
    window_s: float,
) -> Sample:
    """``streams`` closed-loop clients, started evenly over ``ramp_s`` (one request's length, so they
    do not move in step); measured over a steady ``window_s`` after the ramp, then drained."""
    loop = asyncio.get_running_loop()
    tally = Tally()
    counting = False
    stopping = False
    in_flight = 0

    async def client(i: int) -> None:
        nonlocal in_flight
        await asyncio.sleep(ramp_s * i / streams)
        while not stopping:
            in_flight += 1
            part = Tally()
            await request(s, gw.chat_url, body, True, part)
            in_flight -= 1
            if counting:  # ended inside the window: it counts
                tally.ok += part.ok
                tally.errors += part.errors
                tally.lat_ms += part.lat_ms
                tally.first_error = tally.first_error or part.first_error

    tasks = [asyncio.create_task(client(i)) for i in range(streams)]
    try:
        await asyncio.sleep(ramp_s * 1.1)
        start, counting = meter.read(), True
        seen: list[int] = []
        end = loop.time() + window_s
        while loop.time() < end:
            seen.append(in_flight)
            await asyncio.sleep(0.1)
        result = meter.sample(start, tally, statistics.fmean(seen) if seen else 0.0)
        counting = False
    finally:
        stopping = True
        await asyncio.gather(*tasks)
    return result


async def realistic_bench(a: argparse.Namespace, workdir: Path) -> dict[str, object]:
    timing = ["--ttft-ms", str(a.ttft_ms), "--tokens-per-s", str(a.tokens_per_s), "--slots", "100000"]
    engines = [ro.start_engine(*timing, model=MODEL) for _ in range(a.engines)]
    procs = [p for p, _ in engines]
    urls = [u for _, u in engines]
    gateways: list[Gateway] = []
    nominal_ms = a.ttft_ms + a.tokens * 1000 / a.tokens_per_s
    try:
        gateways, skipped = await start_all(_spawners(a, urls, workdir, with_aiohttp=True))
        body = chat_body(a.tokens, True)
        results: dict[str, dict[str, Sample]] = {}
        async with session(timeout_s=max(ro.CLIENT_TIMEOUT_S, nominal_ms / 1000 * 5)) as s:
            for level, n in enumerate(a.streams):
                per: dict[str, Sample] = {}
                for g in gateways if level % 2 == 0 else reversed(gateways):
                    per[g.name] = await open_streams(
                        s, g, Meter(g, procs), body, n, nominal_ms / 1000, a.window
                    )
                results[str(n)] = per
                for name, x in per.items():
                    print(f"  {n} streams, {name}: {_realistic_line(x, nominal_ms)}", flush=True)
        return {"skipped": skipped, "results": results, "nominal_ms": nominal_ms}
    finally:
        for g in gateways:
            g.stop()
        for p in procs:
            ro.stop(p)


def _realistic_line(x: Sample, nominal_ms: float) -> str:
    return (
        f"{x.rps:.0f} req/s, {x.open_streams:.0f} open, p50 {x.p50_ms:.0f} ms, "
        f"router {x.gateway_cpu_s / x.seconds:.3f} cores, {x.gateway_ms_per_req:.2f} ms CPU/req, "
        f"errors {x.errors}{' (' + x.first_error + ')' if x.first_error else ''}"
    )


def realistic_table(results: dict[str, dict[str, Sample]], nominal_ms: float, streams_per_req: int) -> str:
    head = [
        "open streams (asked / held)",
        "router",
        "req/s",
        "p50 / p99 ms",
        "router cores",
        "cores per 1,000 req/s",
        "cores per 1,000 open streams",
        "router CPU ms/req",
        "share of request wall",
        "engine cores",
        "generator cores",
        "machine busy",
        "sustained",
    ]
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    short: list[str] = []
    for n, per in results.items():
        for name, x in per.items():
            cores = x.gateway_cpu_s / x.seconds if x.seconds else 0.0
            expected = int(n) / (nominal_ms / 1000)
            # Held: the rate a machine keeping pace would give, and answers close to their nominal length.
            held = (
                x.errors == 0
                and x.rps >= 0.9 * expected
                and x.open_streams >= 0.9 * int(n)
                and x.p50_ms <= 1.15 * nominal_ms
            )
            if not held:
                short.append(f"{name} at {n}")
            gen = x.generator_cores
            row = [
                f"{n} / {x.open_streams:.0f}",
                name,
                f"{x.rps:.0f}",
                f"{x.p50_ms:.0f} / {x.p99_ms:.0f}",
                f"{cores:.3f}",
                f"{cores / x.rps * 1000:.3f}" if x.rps else "-",
                f"{cores / x.open_streams * 1000:.3f}" if x.open_streams else "-",
                f"{x.gateway_ms_per_req:.2f}",
                f"{x.gateway_ms_per_req / x.p50_ms:.3%}" if x.p50_ms == x.p50_ms and x.p50_ms else "-",
                f"{x.engine_cpu_s / x.seconds:.2f}",
                f"{gen:.2f}{' GEN-BOUND' if gen >= GEN_BOUND else ''}",
                f"{x.machine_busy:.0%}",
                "yes" if held else f"NO (expected {expected:.0f} req/s)",
            ]
            lines.append("| " + " | ".join(row) + " |")
    lines.append(
        f"\nA request: {nominal_ms:.0f} ms nominal ({streams_per_req} tokens). 'share of request wall': router "
        "CPU per request over the request's p50 wall time (the issue's rule: a well-kept server under 1 %). "
        "aiohttp.web is a bare pass-through (no auth, no routing, no usage): the floor a swap would start from. "
        "llmgw's figure is its whole router (server, auth, routing, usage): an upper bound on its HTTP server's."
    )
    for name in dict.fromkeys(x for per in results.values() for x in per):
        worst = max(
            per[name].gateway_ms_per_req / per[name].p50_ms for per in results.values() if name in per
        )
        lines.append(
            f"{name}: at most {worst:.3%} of a request's wall time in CPU "
            f"({'under' if worst < 0.01 else 'OVER'} the 1 % rule)"
        )
    if short:
        lines.append(
            f"NOT SUSTAINED on this machine: {', '.join(short)}: the engines, generator and routers together "
            "did not keep pace (see machine busy); the figures there are at a lower real load than asked."
        )
    return "\n".join(lines)


# ---------------------------------------------------------------- main


def _peer(a: argparse.Namespace) -> Path:
    return ensure_vllm_router(a.peer_venv)


def _header(a: argparse.Namespace) -> str:
    rev = subprocess.run(
        ["git", "-C", str(Path(__file__).resolve().parents[1]), "describe", "--always", "--dirty"],
        capture_output=True,
        text=True,
    ).stdout.strip()
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    return (
        f"command: {shlex.join(sys.orig_argv)}\n"
        f"llmgw {a.llmgw_rev or rev or '?'} | vllm-router {installed_vllm_router(a.peer_venv) or 'not installed'} "
        f"(--policy {a.vllm_router_policy}) | python {sys.version.split()[0]} | "
        f"{os.cpu_count()} cores, load average {load} | {time.strftime('%Y-%m-%d %H:%M:%S %Z')}"
    )


def _to_json(x: object) -> object:
    if isinstance(x, Sample):
        return {**asdict(x), "rps": x.rps, "gateway_ms_per_req": x.gateway_ms_per_req}
    if isinstance(x, dict):
        return {k: _to_json(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_to_json(v) for v in x]
    return x


async def main(a: argparse.Namespace) -> int:
    print(_header(a), flush=True)
    with tempfile.TemporaryDirectory(prefix="llmgw-peers-") as tmp:
        if a.realistic:
            print(
                f"realistic: {a.engines} sim-engine(s) --ttft-ms {a.ttft_ms:g} --tokens-per-s "
                f"{a.tokens_per_s:g}, {a.tokens}-token streams, {a.window:g} s window per level and router",
                flush=True,
            )
            out = await realistic_bench(a, Path(tmp))
            results = out["results"]
            assert isinstance(results, dict)
            print("\n" + realistic_table(results, float(str(out["nominal_ms"])), a.tokens))
        else:
            print(
                f"peer bench: one sim-engine --zero, {a.seconds:g} s per case and target, median of "
                f"{a.repeats}, targets interleaved; clients {','.join(map(str, a.clients))}",
                flush=True,
            )
            out = await peer_bench(a, Path(tmp))
            results, gateways = out["results"], out["gateways"]
            assert isinstance(results, dict) and isinstance(gateways, list)
            print("\n" + peer_table(results, gateways))
        for line in out["skipped"]:  # type: ignore[attr-defined]
            print(line)
        print(
            "\nllmgw checks an API key per request; vllm-router and aiohttp.web check none. "
            "CPU: user+sys of the gateway's whole process tree."
        )
    if a.json:
        _write_json(a.json, out)
    return 0


def _write_json(path: str, out: dict[str, object]) -> None:
    Path(path).write_text(json.dumps(_to_json(out), indent=1))


def parse(argv: Sequence[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ints = lambda s: [int(x) for x in s.split(",") if x]  # noqa: E731
    ap.add_argument("--quick", action="store_true", help="a smoke of about a minute (rough figures)")
    ap.add_argument("--seconds", type=float, help="per case and target (peer bench; 10, quick 2)")
    ap.add_argument("--repeats", type=int, help="repeats per case, the median reported (2, quick 1)")
    ap.add_argument("--clients", type=ints, default=[1, 8, 32], help="closed-loop clients, comma list")
    ap.add_argument("--vllm-router-policy", default="round_robin")
    ap.add_argument("--peer-venv", type=Path, default=PEER_VENV, help="where vllm-router is (installed)")
    ap.add_argument("--no-peer", action="store_true", help="leave vllm-router out")
    ap.add_argument("--with-aiohttp", action="store_true", help="peer bench: add the aiohttp.web proxy")
    ap.add_argument("--llmgw-rev", help="run this git revision's llmgw router instead of the work tree's")
    ap.add_argument("--realistic", action="store_true", help="point 3: routers under realistic timing")
    ap.add_argument("--streams", type=ints, help="open streams (realistic; 100,400,1000, quick 50,100)")
    ap.add_argument("--engines", type=int, default=2, help="simulated engines (realistic)")
    ap.add_argument("--ttft-ms", type=float, default=200.0)
    ap.add_argument("--tokens-per-s", type=float, default=50.0)
    ap.add_argument("--tokens", type=int, default=100, help="tokens per streamed answer (realistic)")
    ap.add_argument("--window", type=float, help="measured seconds per level (realistic; 10, quick 5)")
    ap.add_argument("--json", help="also write every sample to this file")
    a = ap.parse_args(argv)
    # What was not given explicitly: the full run's value, or --quick's.
    defaults = {"seconds": (10.0, 2.0), "repeats": (2, 1), "streams": ([100, 400, 1000], [50, 100])}
    defaults["window"] = (10.0, 5.0)
    for name, (full, quick) in defaults.items():
        if getattr(a, name) is None:
            setattr(a, name, quick if a.quick else full)
    return a


if __name__ == "__main__":
    if sys.argv[1:2] == ["_aiohttp_proxy"]:
        import uvloop

        uvloop.run(_serve_aiohttp_proxy(int(sys.argv[2]), sys.argv[3:]))
        sys.exit(0)
    args = parse()
    try:
        import uvloop
    except ImportError:
        sys.exit(asyncio.run(main(args)))
    sys.exit(uvloop.run(main(args)))
