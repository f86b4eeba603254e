"""The router's Python CPU per proxied request, in one process, without sockets: for a shared machine.

``bench/router_ab.py`` measures the router as a process; on a 2-core machine that other work loads,
its figures move by more than one change on the request path saves. This drives the router's own
code (its HTTP connection, the app, the proxy, the upstream client) with in-memory transports: a
request's bytes go to a ``Connection`` as if they came from a socket, the engine's answer (a
zero-delay sim engine's, recorded) comes back to the upstream connection as soon as it was sent.
What is left is the Python (and the C it calls) a request costs the router, minus the syscalls.
Prints CPU microseconds per request (process time, min and median over rounds).

Process time still moves with the machine's load (caches, frequency). ``--callgrind`` counts
instructions instead (valgrind's callgrind): the same code gives the same count whatever else runs.
Each side runs twice, with 300 and 1,300 requests a round, and the difference over the 2,000 extra
requests (warm-up rounds included) is the count per request, start-up and imports cancelled out. Slow
(minutes a side under load), but a 2% change is visible.

    .venv/bin/python bench/router_hotpath.py                # this tree
    .venv/bin/python bench/router_hotpath.py --old HEAD~2   # a revision's, then this tree's
    .venv/bin/python bench/router_hotpath.py --old HEAD~2 --callgrind
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

KEY = "llmgw-bench-" + "x" * 32
BODY = b'{"model": "bench", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 16}'
REQUEST = (
    b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:8080\r\nUser-Agent: Python/3.11 aiohttp/3.14.5\r\n"
    b"Authorization: Bearer " + KEY.encode() + b"\r\nContent-Type: application/json\r\nAccept: */*\r\n"
    b"Accept-Encoding: gzip, deflate\r\nContent-Length: %d\r\n\r\n%s" % (len(BODY), BODY)
)
_ANSWER_BODY = (
    b'{"id": "chatcmpl-cb294ec41", "object": "chat.completion", "created": 1796120188, "model": "bench", '
    b'"choices": [{"index": 0, "message": {"role": "assistant", "content": "hello hello hello hello hello '
    b'hello hello hello hello hello hello hello hello hello hello hello"}, "logprobs": null, '
    b'"finish_reason": "length"}], "usage": {"prompt_tokens": 1, "completion_tokens": 16, "total_tokens": 17}}'
)
ANSWER = (
    b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n"
    b"Date: Tue, 01 Dec 2026 10:16:28 GMT\r\nServer: Python/3.11 aiohttp/3.14.5\r\n\r\n%s"
    % (len(_ANSWER_BODY), _ANSWER_BODY)
)


class _Transport(asyncio.Transport):
    """What a protocol writes to: calls ``on_write`` with the bytes (on the loop, as a socket would)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, on_write: Any) -> None:
        super().__init__()
        self.loop, self.on_write, self.closing = loop, on_write, False

    def write(self, data: bytes | bytearray | memoryview) -> None:
        self.loop.call_soon(self.on_write, data)

    def writelines(self, parts: Any) -> None:
        self.write(b"".join(parts))

    def is_closing(self) -> bool:
        return self.closing

    def close(self) -> None:
        self.closing = True

    abort = close

    def get_write_buffer_size(self) -> int:
        return 0

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return default


async def run(conc: int, per_round: int, rounds: int) -> list[float]:
    from llmgw_router.service import Router

    try:
        from llmgw_router.http.connection import Connection
    except ImportError:  # a revision from before the router's rooms (issue 36, --old)
        from llmgw_router.http_connection import Connection  # type: ignore[no-redef]

    try:
        from llmgw_router.settings import RouterSettings
    except ImportError:  # a revision from before each service owned its settings (--old)
        from llmgw_common.settings import RouterSettings  # type: ignore[no-redef]

    try:
        from llmgw_router.upstream.connection import UpstreamConnection
    except ImportError:  # a revision from before the router's rooms (issue 36, --old)
        from llmgw_router.upstream_connection import UpstreamConnection  # type: ignore[no-redef]

    loop = asyncio.get_running_loop()
    engine = "http://127.0.0.1:9"
    with tempfile.TemporaryDirectory() as tmp:
        static = Path(tmp) / "static.yaml"
        h = hashlib.sha256(KEY.encode()).hexdigest()
        static.write_text(
            f"keys: [{{name: bench, hash: {h}}}]\nmodels:\n  - {{name: bench, endpoints: [{engine}]}}\n"
        )
        router = Router(RouterSettings(static_file=str(static), port=0, router_id="hotpath"))
        await router.start()
    assert router.http is not None and router.ctx.upstream is not None
    up = router.ctx.upstream
    key = up._target(engine)[0]
    ups = []
    for _ in range(conc):
        c = UpstreamConnection(loop)
        c.connection_made(_Transport(loop, lambda _data, c=c: c.data_received(ANSWER)))
        c.idle_since = time.monotonic()
        ups.append(c)
    up._idle[key] = ups
    left = 0
    done = asyncio.Event()
    ok = [0]

    def client(conn: Connection) -> Any:
        def on_write(data: bytes) -> None:
            nonlocal left
            if not data.startswith(b"HTTP/1.1 200"):
                raise SystemExit(f"unexpected answer: {data[:200]!r}")
            ok[0] += 1
            if left > 0:
                left -= 1
                conn.data_received(REQUEST)
            elif ok[0] >= total:
                done.set()

        return on_write

    conns = []
    for _ in range(conc):
        conn = Connection(router.http)
        router.http.connections.add(conn)
        conn.connection_made(_Transport(loop, client(conn)))
        conns.append(conn)
    out = []
    for r in range(rounds + 1):
        total = per_round
        ok[0] = 0
        left = per_round - conc
        done.clear()
        t0 = time.process_time()
        for conn in conns:
            conn.data_received(REQUEST)
        await done.wait()
        if r:  # the first round warms up
            out.append((time.process_time() - t0) * 1e6 / per_round)
    await router.stop()
    return out


def instructions(pythonpath: str | None, conc: int, tmp: Path) -> float:
    """Instructions per request under callgrind: runs of 300 and 1,300 requests a round (two rounds)
    at once, the difference over the 2,000 more requests."""
    env = dict(os.environ, LLMGW_LOG_LEVEL="WARNING")
    if pythonpath:
        env["PYTHONPATH"] = pythonpath
    procs: list[subprocess.Popen[str]] = []
    for n in (300, 1300):
        out = tmp / f"cg-{os.getpid()}-{len(procs)}-{n}"
        cmd = ["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}", sys.executable, __file__]
        cmd += ["--child", "--conc", str(conc), "--requests", str(n), "--rounds", "1"]
        procs.append(
            subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        )
    counts = []
    for p in procs:
        _, err = p.communicate()
        # A child that failed (an --old tree this script cannot drive) must not print a count: its
        # start-up alone once gave "315 instructions/request".
        if p.returncode != 0 or "Collected : " not in err:
            raise SystemExit(f"callgrind run failed ({p.returncode}):\n{err[-2000:]}")
        counts.append(int(err.split("Collected : ")[1].split()[0]))
    return (counts[1] - counts[0]) / 2000


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--old", help="also measure this revision (its tree exported with git archive)")
    ap.add_argument("--conc", type=int, default=64)
    ap.add_argument("--requests", type=int, default=5000, help="per round")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--callgrind", action="store_true", help="count instructions (valgrind) instead")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        import uvloop

        res = uvloop.run(run(a.conc, a.requests, a.rounds))
        print(f"{min(res):.1f} {statistics.median(res):.1f}")
        return
    sides: list[tuple[str, str | None]] = [("working tree", None)]
    tmp = tempfile.TemporaryDirectory(prefix="llmgw-hotpath-")
    if a.old:
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        import router_ab

        sides.insert(0, (a.old, router_ab.export_tree(a.old, Path(tmp.name) / "old")))
    if a.callgrind:
        for name, pp in sides:
            print(f"{name:>14}: {instructions(pp, a.conc, Path(tmp.name)):,.0f} instructions/request")
        tmp.cleanup()
        return
    args = ["--child", "--conc", str(a.conc), "--requests", str(a.requests), "--rounds", str(a.rounds)]
    for _ in range(2):  # two passes, alternating, so both see the same background load
        for name, pp in sides:
            env = dict(os.environ, LLMGW_LOG_LEVEL="WARNING")
            if pp:
                env["PYTHONPATH"] = pp
            cmd = [sys.executable, __file__, *args]
            child = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
            if child.returncode:
                print(f"{name}: failed: {child.stderr[-2000:]}")
                continue
            lo, med = child.stdout.split()
            print(f"{name:>14}: router CPU us/request min {lo} median {med}")
    tmp.cleanup()


if __name__ == "__main__":
    main()
