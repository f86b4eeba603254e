"""The simulated engine's own ceiling: how fast it answers when it adds no delay at all.

Starts ``llmgw sim-engine --zero`` as a real process and drives it with one aiohttp client on uvloop
at several concurrencies, non-streaming and with 100-token streams. Prints requests/s, p50/p99
latency, and the engine's CPU time per request (the figure that bounds it on a loaded machine:
1 / cpu-per-request is what one core of engine can do, whatever the client costs).

    .venv/bin/python bench/sim_engine.py            # about 35 s
    .venv/bin/python bench/sim_engine.py --seconds 1 --concurrency 1,32
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import statistics
import sys
import time
from dataclasses import dataclass

import aiohttp
import psutil

from llmgw_sim.options import SimOptions


@dataclass(frozen=True)
class Result:
    mode: str
    concurrency: int
    requests: int
    errors: int
    seconds: float
    p50_ms: float
    p99_ms: float
    engine_cpu_ms_per_req: float

    @property
    def rps(self) -> float:
        return self.requests / self.seconds


def _pct(sorted_ms: list[float], q: float) -> float:
    if not sorted_ms:
        return float("nan")
    return sorted_ms[min(len(sorted_ms) - 1, int(q * len(sorted_ms)))]


async def _phase(
    session: aiohttp.ClientSession, url: str, body: bytes, stream: bool, conc: int, seconds: float
) -> tuple[list[float], int, float]:
    latencies: list[float] = []
    errors = 0
    loop = asyncio.get_running_loop()
    end = loop.time() + seconds
    headers = {"Content-Type": "application/json"}

    async def worker() -> None:
        nonlocal errors
        while loop.time() < end:
            t0 = time.perf_counter()
            async with session.post(url, data=body, headers=headers) as r:
                data = await r.read()
                ok = r.status == 200 and (not stream or data.endswith(b"data: [DONE]\n\n"))
            if ok:
                latencies.append((time.perf_counter() - t0) * 1000)
            else:
                errors += 1

    t0 = loop.time()
    await asyncio.gather(*(worker() for _ in range(conc)))
    return latencies, errors, loop.time() - t0


async def run(seconds: float, concurrencies: list[int], tokens: int) -> list[Result]:
    opts = SimOptions(port=0, zero=True, slots=4096)
    proc = await asyncio.create_subprocess_exec(
        *opts.command(), "--log-level", "WARNING", stdout=asyncio.subprocess.PIPE, start_new_session=True
    )
    assert proc.stdout is not None
    try:
        line = (await asyncio.wait_for(proc.stdout.readline(), 20)).decode()
        base = line.split()[3]
        engine = psutil.Process(proc.pid)
        url = base + "/v1/chat/completions"
        msgs = [{"role": "user", "content": "benchmark the simulated engine please"}]
        bodies = {
            "non-stream": json.dumps({"model": opts.model, "messages": msgs, "max_tokens": 16}).encode(),
            f"stream-{tokens}": json.dumps(
                {"model": opts.model, "messages": msgs, "max_tokens": tokens, "stream": True}
            ).encode(),
        }
        results: list[Result] = []
        conn = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(connector=conn) as session:
            for mode, body in bodies.items():
                stream = mode != "non-stream"
                await _phase(session, url, body, stream, 8, min(0.5, seconds))  # warm up connections
                for conc in concurrencies:
                    cpu0 = sum(engine.cpu_times()[:2])
                    lat, errors, took = await _phase(session, url, body, stream, conc, seconds)
                    cpu = sum(engine.cpu_times()[:2]) - cpu0
                    lat.sort()
                    results.append(
                        Result(
                            mode,
                            conc,
                            len(lat),
                            errors,
                            took,
                            statistics.median(lat) if lat else float("nan"),
                            _pct(lat, 0.99),
                            cpu * 1000 / max(len(lat), 1),
                        )
                    )
                    r = results[-1]
                    print(
                        f"{r.mode:>11} c={r.concurrency:<3} {r.rps:8.0f} req/s  p50 {r.p50_ms:6.2f} ms  "
                        f"p99 {r.p99_ms:6.2f} ms  engine cpu {r.engine_cpu_ms_per_req:.3f} ms/req  "
                        f"errors {r.errors}",
                        flush=True,
                    )
        return results
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            await asyncio.wait_for(proc.wait(), 5)
        except TimeoutError:
            proc.kill()
            await proc.wait()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=3.0, help="length of each phase")
    ap.add_argument("--concurrency", default="1,8,32,64", help="comma-separated concurrencies")
    ap.add_argument("--tokens", type=int, default=100, help="tokens per streamed answer")
    ap.add_argument("--json", action="store_true", help="also print the results as one JSON line")
    a = ap.parse_args()
    concs = [int(c) for c in a.concurrency.split(",") if c]
    print(
        f"sim-engine --zero, one aiohttp client, {a.seconds:g} s per phase, python {sys.version.split()[0]}"
    )
    t0 = time.monotonic()
    try:
        import uvloop

        results = uvloop.run(run(a.seconds, concs, a.tokens))
    except ImportError:
        results = asyncio.run(run(a.seconds, concs, a.tokens))
    print(f"total {time.monotonic() - t0:.1f} s")
    if a.json:
        print(json.dumps([{**r.__dict__, "rps": round(r.rps, 1)} for r in results]))


if __name__ == "__main__":
    main()
