"""What tracing costs the router per request (issue 34): its CPU per proxied request, side by side, with
tracing off and on.

Drives the router's own code in one process without sockets, as ``bench/router_hotpath.py`` does (its
in-memory client and zero-delay engine, reused), once per case, each case in a process of its own:

    off                  no otlp_traces_endpoint (the default), the client sends no traceparent
    off, traceparent     the same, the client sends one: checked and passed on to the engine
    on, sampled 0%       tracing on, no trace recorded (ids made and sent on; spans not recorded)
    on, sampled 10%      one trace in ten recorded and exported
    on, sampled 100%     every request a SERVER and a CLIENT span, exported over OTLP/HTTP

Spans go to a real OTLP/HTTP endpoint: a small sink in another process that answers 200 to every
export (the cost measured is the router's: building, batching, encoding and sending the spans, on the
SDK's thread, which this process's CPU time includes). Prints CPU microseconds per request (process
time: min and median over rounds) and the difference from "off".

Process time moves with the machine's load; ``--callgrind`` counts instructions per request instead
(valgrind's callgrind, as ``bench/router_hotpath.py --callgrind``: runs of 300 and 1,300 requests a
round, the difference over the 2,000 more), the same whatever else runs. The SDK's export thread is
counted too; at 100% sampling a batch not yet exported at the run's end is not (a few per cent).

    .venv/bin/python bench/tracing_overhead.py             # about a minute
    .venv/bin/python bench/tracing_overhead.py --requests 2000 --rounds 3   # rougher
    .venv/bin/python bench/tracing_overhead.py --callgrind  # minutes, exact
"""

from __future__ import annotations

import argparse
import http.server
import os
import statistics
import subprocess
import sys
import threading
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.kit.ports import free_port

TRACEPARENT = b"traceparent: 00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01\r\n"
CASES: list[tuple[str, dict[str, str], bool]] = [
    ("off", {}, False),
    ("off, traceparent", {}, True),
    ("on, sampled 0%", {"LLMGW_TRACE_SAMPLE_RATIO": "0"}, False),
    ("on, sampled 10%", {"LLMGW_TRACE_SAMPLE_RATIO": "0.1"}, False),
    ("on, sampled 100%", {"LLMGW_TRACE_SAMPLE_RATIO": "1"}, False),
]


class _Sink(http.server.BaseHTTPRequestHandler):
    """An OTLP/HTTP receiver that takes every export and keeps nothing."""

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, format: str, *args: object) -> None:
        pass


def sink(port: int) -> None:
    http.server.ThreadingHTTPServer(("127.0.0.1", port), _Sink).serve_forever()


def child(conc: int, requests: int, rounds: int, traceparent: bool) -> None:
    import uvloop

    import router_hotpath as hp

    if traceparent:
        # The client's header among the others, before the body.
        hp.REQUEST = hp.REQUEST.replace(b"Accept: */*\r\n", b"Accept: */*\r\n" + TRACEPARENT)
    res = uvloop.run(hp.run(conc, requests, rounds))
    print(f"{min(res):.1f} {statistics.median(res):.1f}")


def instructions(env: dict[str, str], traceparent: bool, conc: int, tmp: Path) -> float:
    """Instructions per request under callgrind (see the module's doc)."""
    procs: list[subprocess.Popen[str]] = []
    for n in (300, 1300):
        out = tmp / f"cg-{os.getpid()}-{len(procs)}-{n}"
        cmd = ["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}", sys.executable, __file__]
        cmd += ["--child", "--conc", str(conc), "--requests", str(n), "--rounds", "1"]
        cmd += ["--traceparent"] if traceparent else []
        procs.append(
            subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        )
    counts = []
    for p in procs:
        _, err = p.communicate()
        if p.returncode != 0 or "Collected : " not in err:
            raise SystemExit(f"callgrind run failed ({p.returncode}):\n{err[-2000:]}")
        counts.append(int(err.split("Collected : ")[1].split()[0]))
    return (counts[1] - counts[0]) / 2000


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--conc", type=int, default=64)
    ap.add_argument("--requests", type=int, default=5000, help="per round")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--passes", type=int, default=2, help="passes over the cases, alternating")
    ap.add_argument("--callgrind", action="store_true", help="count instructions (valgrind) instead")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--traceparent", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--sink", type=int, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.sink:
        sink(a.sink)
        return
    if a.child:
        child(a.conc, a.requests, a.rounds, a.traceparent)
        return
    port = free_port()
    receiver = subprocess.Popen([sys.executable, __file__, "--sink", str(port)])
    endpoint = f"http://127.0.0.1:{port}/v1/traces"
    medians: dict[str, list[float]] = {name: [] for name, _, _ in CASES}
    mins: dict[str, list[float]] = {name: [] for name, _, _ in CASES}
    try:
        if a.callgrind:
            import tempfile

            with tempfile.TemporaryDirectory(prefix="llmgw-tracing-") as tmp:
                base_count = 0.0
                print(f"{'case':<18} {'instructions/request':>21} {'vs off':>10}")
                for name, env_extra, tp in CASES:
                    env = dict(os.environ, LLMGW_LOG_LEVEL="WARNING", **env_extra)
                    if name.startswith("on"):
                        env["LLMGW_OTLP_TRACES_ENDPOINT"] = endpoint
                    n = instructions(env, tp, a.conc, Path(tmp))
                    base_count = base_count or n
                    print(f"{name:<18} {n:21,.0f} {n - base_count:+10,.0f}", flush=True)
            return
        for _ in range(a.passes):  # alternating, so every case sees the same background load
            for name, env_extra, tp in CASES:
                env = dict(os.environ, LLMGW_LOG_LEVEL="WARNING", **env_extra)
                if name.startswith("on"):
                    env["LLMGW_OTLP_TRACES_ENDPOINT"] = endpoint
                cmd = [sys.executable, __file__, "--child", "--conc", str(a.conc)]
                cmd += ["--requests", str(a.requests), "--rounds", str(a.rounds)]
                cmd += ["--traceparent"] if tp else []
                out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
                if out.returncode:
                    raise SystemExit(f"{name}: failed:\n{out.stderr[-3000:]}")
                lo, med = map(float, out.stdout.split())
                mins[name].append(lo)
                medians[name].append(med)
    finally:
        receiver.terminate()
        receiver.wait()
    base = min(mins["off"])
    print(f"router CPU per proxied request ({a.requests} requests x {a.rounds} rounds, {a.passes} passes):")
    print(f"{'case':<18} {'min us':>8} {'median us':>10} {'vs off':>8}")
    for name, _, _ in CASES:
        lo, med = min(mins[name]), statistics.median(medians[name])
        print(f"{name:<18} {lo:8.1f} {med:10.1f} {lo - base:+8.1f}")


if __name__ == "__main__":
    threading.excepthook = lambda args: None  # the sink's threads at its end
    main()
