"""What the router adds: direct to a zero-delay simulated engine vs through the router, side by side.

Starts ``llmgw sim-engine --zero`` and ``llmgw router --static`` (auth on, one key) as real processes
and drives both with one aiohttp client on uvloop:

1. the highest rate each sustains with no errors, non-streaming and 100-token streams: the best
   error-free rate of a closed-loop run (64 concurrent) and of a bounded search over open-loop (paced)
   rates (a paced rate counts when every request succeeded and p99 stayed under 1 s);
2. p50/p99 latency at half the router's maximum rate, for both paths at that same rate (alternating
   short slices, so both see the same background load), and again at 100 requests/s;
3. CPU time per request of the router and of the engine (1 / cpu-per-request is what one core does,
   whatever else shares the machine);
4. the router's peak RSS with 1,000 streams open at once (a slow engine keeps them open ~4 s).

    .venv/bin/python bench/router_overhead.py            # about 2 minutes
    .venv/bin/python bench/router_overhead.py --quick    # about 40 s, rougher
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import psutil

# The one free-port helper (tests/kit/ports.py), as bench/autoscale.py reaches the test kit.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.kit.ports import free_port

KEY = "llmgw-bench-" + "x" * 32
LOW_RPS = 100
CLIENT_TIMEOUT_S = 30.0
NONSTREAM = json.dumps(
    {"model": "bench", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 16}
).encode()
STREAM = json.dumps(
    {"model": "bench", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 100, "stream": True}
).encode()


def _pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    v = sorted(values)
    return v[min(len(v) - 1, int(q * len(v)))]


# ---------------------------------------------------------------- processes


def start_engine(*extra: str, model: str = "bench") -> tuple[subprocess.Popen[bytes], str]:
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "llmgw_cli",
            "sim-engine",
            "--port",
            "0",
            "--model",
            model,
            "--log-level",
            "WARNING",
            *extra,
        ],
        stdout=subprocess.PIPE,
        start_new_session=True,
    )
    assert proc.stdout is not None
    line = proc.stdout.readline().decode()
    if "listening on" not in line:
        stop(proc)
        raise RuntimeError(f"sim-engine did not start: {line!r}")
    return proc, line.split("listening on ", 1)[1].split()[0]


def start_router(static: Path, port: int, pythonpath: str | None = None) -> subprocess.Popen[bytes]:
    """``pythonpath``: run another tree's router (bench/router_ab.py compares two revisions)."""
    env = dict(os.environ, LLMGW_LOG_LEVEL="WARNING")
    if pythonpath:
        env["PYTHONPATH"] = pythonpath
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "llmgw_cli",
            "router",
            "--static",
            str(static),
            "--port",
            str(port),
            "--router-id",
            "bench",
        ],
        start_new_session=True,
        env=env,
    )


def stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(5)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    if proc.stdout:
        proc.stdout.close()


async def wait_http(url: str, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    async with aiohttp.ClientSession() as s:
        while time.monotonic() < deadline:
            with contextlib.suppress(aiohttp.ClientError):
                async with s.get(url) as r:
                    if r.status == 200:
                        return
            await asyncio.sleep(0.05)
    raise RuntimeError(f"{url} did not come up")


# ---------------------------------------------------------------- load


@dataclass
class Run:
    target: float | None
    sent: int
    ok: int
    errors: int
    seconds: float
    lat_ms: list[float]
    # Requests that hit the client's timeout (CLIENT_TIMEOUT_S): a stall, not a slow answer.
    stalls: int = 0

    @property
    def rate(self) -> float:
        return self.ok / self.seconds

    @property
    def p50(self) -> float:
        return _pct(self.lat_ms, 0.50)

    @property
    def p99(self) -> float:
        return _pct(self.lat_ms, 0.99)


async def _one(s: aiohttp.ClientSession, url: str, body: bytes, stream: bool, run: Run) -> None:
    t0 = time.perf_counter()
    try:
        async with s.post(url, data=body) as r:
            data = await r.read()
            good = r.status == 200 and (not stream or data.endswith(b"data: [DONE]\n\n"))
    except aiohttp.ClientError:
        good = False
    except TimeoutError:
        good = False
        run.stalls += 1
        print(
            f"stall: a request to {url} got no answer in {s.timeout.total:g}s "
            f"(started {time.strftime('%H:%M:%S', time.localtime(time.time() - (time.perf_counter() - t0)))})",
            file=sys.stderr,
            flush=True,
        )
    if good:
        run.ok += 1
        run.lat_ms.append((time.perf_counter() - t0) * 1000)
    else:
        run.errors += 1


async def closed_loop(s: aiohttp.ClientSession, url: str, stream: bool, conc: int, seconds: float) -> Run:
    body = STREAM if stream else NONSTREAM
    run = Run(None, 0, 0, 0, seconds, [])
    loop = asyncio.get_running_loop()
    end = loop.time() + seconds

    async def worker() -> None:
        while loop.time() < end:
            run.sent += 1
            await _one(s, url, body, stream, run)

    t0 = loop.time()
    await asyncio.gather(*(worker() for _ in range(conc)))
    run.seconds = loop.time() - t0
    return run


async def open_loop(s: aiohttp.ClientSession, url: str, stream: bool, rate: float, seconds: float) -> Run:
    """Launch requests on a fixed schedule (no coordinated omission), wait for all of them."""
    body = STREAM if stream else NONSTREAM
    run = Run(rate, 0, 0, 0, seconds, [])
    loop = asyncio.get_running_loop()
    tasks: set[asyncio.Task[None]] = set()
    t0 = loop.time()
    n = int(rate * seconds)
    for i in range(n):
        due = t0 + i / rate
        delay = due - loop.time()
        if delay > 0:
            await asyncio.sleep(delay)
        t = asyncio.create_task(_one(s, url, body, stream, run))
        tasks.add(t)
        t.add_done_callback(tasks.discard)
        run.sent += 1
    launched = loop.time() - t0
    await asyncio.gather(*list(tasks))
    # Achieved rate: completions over the time until the last one finished.
    run.seconds = max(loop.time() - t0, seconds)
    # A pacer that fell behind did not offer the target rate: count that as not sustained.
    if launched > seconds * 1.03:
        run.errors += 1
    return run


def _merge(into: Run, part: Run) -> None:
    into.sent += part.sent
    into.ok += part.ok
    into.errors += part.errors
    into.stalls += part.stalls
    into.seconds += part.seconds
    into.lat_ms.extend(part.lat_ms)


def sustained(run: Run) -> bool:
    assert run.target is not None
    # p99 bound generous: on a shared 2-core machine a scheduler hiccup alone can reach 100 ms.
    return run.errors == 0 and run.rate >= 0.97 * run.target and run.p99 < 1000.0


# name -> (process, base URL), filled by main(): what diagnose_stall() looks at.
WATCHED: dict[str, tuple[subprocess.Popen[bytes], str]] = {}


async def diagnose_stall() -> None:
    """Which hop is stuck: each process's state and CPU time, and whether it answers /health now."""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2)) as s:
        for name, (proc, base) in WATCHED.items():
            try:
                p = psutil.Process(proc.pid)
                state = f"{p.status()}, cpu {cpu_s(proc.pid):.1f}s, {p.num_fds()} fds"
            except psutil.Error as e:
                state = f"gone ({e})"
            try:
                async with s.get(base + "/health") as r:
                    health = str(r.status)
            except (aiohttp.ClientError, TimeoutError) as e:
                health = f"no answer ({type(e).__name__})"
            print(f"  stall diagnosis: {name}: {state}; /health: {health}", file=sys.stderr, flush=True)


async def max_rate(
    s: aiohttp.ClientSession, url: str, stream: bool, seconds: float, steps: int
) -> tuple[float, int]:
    """Highest rate achieved with no errors: a closed-loop estimate, then a bounded open-loop search.

    Also returns how many requests stalled (hit the client timeout) in the closed loop.
    """
    est = await closed_loop(s, url, stream, 64, seconds)
    stalls = est.stalls
    if stalls:
        # A stalled closed loop measures the stall (ok / (seconds + the client timeout)), not the rate,
        # and the search below is bounded by its estimate (max(estimate * 1.15, 50)): that is how one
        # stall read as a router maximum of 6 and 44 requests/s. Say so, say which process is stuck,
        # and estimate again.
        print(f"max_rate {url}: closed loop stalled ({stalls} requests timed out)", file=sys.stderr)
        await diagnose_stall()
        est = await closed_loop(s, url, stream, 64, seconds)
        stalls += est.stalls
    best = est.rate if est.errors == 0 else 0.0
    lo, hi = 0.0, max(est.rate * 1.15, 50.0)
    probe = est.rate * 0.9
    for _ in range(steps):
        r = await open_loop(s, url, stream, probe, seconds)
        if r.errors == 0 and r.p99 < 1000.0:
            best = max(best, r.rate)
        if sustained(r):
            lo = probe
        else:
            hi = probe
        # Bisect once something was sustained; until then step down gently (noise, not a cliff).
        probe = (lo + hi) / 2 if lo else hi * 0.75
        await asyncio.sleep(0.3)
    return best, stalls


async def peak_rss_with_streams(router_url: str, body: bytes, pid: int, n: int) -> tuple[float, float, int]:
    proc = psutil.Process(pid)
    base = proc.memory_info().rss
    peak = base
    done = asyncio.Event()

    async def sample() -> None:
        nonlocal peak
        while not done.is_set():
            peak = max(peak, proc.memory_info().rss)
            await asyncio.sleep(0.05)

    conn = aiohttp.TCPConnector(limit=0)
    headers = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    ok = 0
    async with aiohttp.ClientSession(connector=conn, headers=headers) as s:
        sampler = asyncio.create_task(sample())
        run = Run(None, 0, 0, 0, 0, [])
        await asyncio.gather(*(_one(s, router_url, body, True, run) for _ in range(n)))
        ok = run.ok
        done.set()
        await sampler
    return base / 2**20, peak / 2**20, ok


# ---------------------------------------------------------------- main


def cpu_s(pid: int) -> float:
    t = psutil.Process(pid).cpu_times()
    return t.user + t.system


async def main(quick: bool) -> int:
    seconds = 1.0 if quick else 2.0
    steps = 3 if quick else 4
    procs: list[subprocess.Popen[bytes]] = []
    out: dict[str, object] = {}
    try:
        eng, eng_url = start_engine("--zero", "--slots", "4096")
        procs.append(eng)
        slow, slow_url = start_engine(
            "--ttft-ms", "0", "--tokens-per-s", "25", "--slots", "4096", model="slow"
        )
        procs.append(slow)
        static = Path(tempfile.mkdtemp(prefix="llmgw-bench-")) / "static.yaml"
        h = hashlib.sha256(KEY.encode()).hexdigest()
        static.write_text(
            f"keys: [{{name: bench, hash: {h}}}]\nmodels:\n  - {{name: bench, endpoints: [{eng_url}]}}\n"
            f"  - {{name: slow, endpoints: [{slow_url}]}}\n"
        )
        port = free_port()
        router = start_router(static, port)
        procs.append(router)
        WATCHED.update(engine=(eng, eng_url), router=(router, f"http://127.0.0.1:{port}"))
        base = f"http://127.0.0.1:{port}"
        await wait_http(base + "/health")
        direct = f"{eng_url}/v1/chat/completions"
        via = f"{base}/v1/chat/completions"
        # Memory first, on a fresh router: 1,000 streams open at once.
        slow_body = STREAM.replace(b'"bench"', b'"slow"')
        rss_base, rss_peak, ok = await peak_rss_with_streams(via, slow_body, router.pid, 1000)
        out["streams_1000"] = {"rss_mb_idle": round(rss_base, 1), "rss_mb_peak": round(rss_peak, 1), "ok": ok}
        print("streams_1000", json.dumps(out["streams_1000"]), flush=True)
        headers = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
        conn = aiohttp.TCPConnector(limit=0)
        timeout = aiohttp.ClientTimeout(total=CLIENT_TIMEOUT_S)
        async with aiohttp.ClientSession(connector=conn, headers=headers, timeout=timeout) as s:
            # Warm both paths (connection pools, first-request costs).
            await closed_loop(s, via, False, 16, 0.5)
            await closed_loop(s, direct, False, 16, 0.5)
            for stream in (False, True):
                mode = "stream100" if stream else "nonstream"
                m_direct, stalls_direct = await max_rate(s, direct, stream, seconds, steps)
                m_router, stalls_router = await max_rate(s, via, stream, seconds, steps)
                half = max(m_router / 2, 10.0)
                # Alternate short slices so both paths see the same background load on a shared box.
                lat_d, lat_r = Run(half, 0, 0, 0, 0, []), Run(half, 0, 0, 0, 0, [])
                cpu_e = cpu_r = 0.0
                for _ in range(4):
                    _merge(lat_d, await open_loop(s, direct, stream, half, seconds * 0.5))
                    e0, r0 = cpu_s(eng.pid), cpu_s(router.pid)
                    _merge(lat_r, await open_loop(s, via, stream, half, seconds * 0.5))
                    cpu_e += cpu_s(eng.pid) - e0
                    cpu_r += cpu_s(router.pid) - r0
                n = max(lat_r.ok, 1)
                # The same at a low rate, where neither path is short of CPU: the router's own cost.
                low_d, low_r = Run(LOW_RPS, 0, 0, 0, 0, []), Run(LOW_RPS, 0, 0, 0, 0, [])
                for _ in range(3):
                    _merge(low_d, await open_loop(s, direct, stream, LOW_RPS, seconds * 0.5))
                    _merge(low_r, await open_loop(s, via, stream, LOW_RPS, seconds * 0.5))
                out[mode] = {
                    "max_rps_direct": round(m_direct),
                    "max_rps_router": round(m_router),
                    # Requests that got no answer within the client timeout in the max-rate phase.
                    "stalls_direct": stalls_direct,
                    "stalls_router": stalls_router,
                    "rate_ratio": round(m_router / m_direct, 2) if m_direct else None,
                    "at_rps": round(half),
                    "p50_ms_direct": round(lat_d.p50, 2),
                    "p99_ms_direct": round(lat_d.p99, 2),
                    "p50_ms_router": round(lat_r.p50, 2),
                    "p99_ms_router": round(lat_r.p99, 2),
                    "added_p50_ms": round(lat_r.p50 - lat_d.p50, 2),
                    "added_p99_ms": round(lat_r.p99 - lat_d.p99, 2),
                    "errors": lat_d.errors + lat_r.errors,
                    f"added_p50_ms_at_{LOW_RPS}rps": round(low_r.p50 - low_d.p50, 2),
                    f"added_p99_ms_at_{LOW_RPS}rps": round(low_r.p99 - low_d.p99, 2),
                    "router_cpu_ms_per_req": round(cpu_r * 1000 / n, 3),
                    "engine_cpu_ms_per_req": round(cpu_e * 1000 / n, 3),
                }
                print(mode, json.dumps(out[mode]), flush=True)
    finally:
        for p in procs:
            stop(p)
    ns, st = out["nonstream"], out["stream100"]
    assert isinstance(ns, dict) and isinstance(st, dict)
    goals = {
        "added p50 < 1 ms (nonstream)": ns["added_p50_ms"] < 1.0,
        "added p99 < 5 ms (nonstream)": ns["added_p99_ms"] < 5.0,
        "added p50 < 1 ms (stream100)": st["added_p50_ms"] < 1.0,
        "added p99 < 5 ms (stream100)": st["added_p99_ms"] < 5.0,
        # Issue 15's goals (were 0.5 for both before the router had its own HTTP server).
        "router rate >= 0.6 of direct (nonstream)": (ns["rate_ratio"] or 0) >= 0.6,
        "router rate >= 0.8 of direct (stream100)": (st["rate_ratio"] or 0) >= 0.8,
        "peak RSS < 200 MB with 1,000 streams": out["streams_1000"]["rss_mb_peak"] < 200,  # type: ignore[index]
    }
    print(json.dumps({"results": out, "goals": goals}, indent=2))
    return 0


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="shorter phases (rougher figures)")
    args = ap.parse_args()
    try:
        import uvloop

        sys.exit(uvloop.run(main(args.quick)))
    except ImportError:
        sys.exit(asyncio.run(main(args.quick)))
