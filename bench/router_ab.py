"""Router CPU per request at two revisions, side by side: the same engine, alternating rounds.

A change on the request path costs microseconds; on a shared 2-core machine one router run against
another differs by more than that. So both routers run at once against one zero-delay engine, and
closed-loop rounds alternate between them (old, new, new, old, ...): whatever else loads the machine
loads both. Prints each side's router CPU per request (min and median over rounds) and request rate.

    .venv/bin/python bench/router_ab.py --old a826ed9            # 12 rounds, about 1 minute
    .venv/bin/python bench/router_ab.py --old HEAD~3 --rounds 20
    .venv/bin/python bench/router_ab.py --old HEAD~3 --stream       # 100-token streams
"""

from __future__ import annotations

import argparse
import hashlib
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent))
import router_overhead as b

PACKAGES = ("libs/llmgw_common", "libs/llmgw_runtime", "services/router", "services/cli", "services/agent",
            "services/controlplane", "services/notifier", "services/sim")  # fmt: skip


def export_tree(rev: str, into: Path) -> str:
    """The source of ``rev`` in ``into`` (git archive: no work tree touched); its PYTHONPATH."""
    repo = Path(__file__).resolve().parent.parent
    archive = subprocess.run(["git", "-C", str(repo), "archive", rev], check=True, capture_output=True)
    into.mkdir(parents=True, exist_ok=True)
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive.stdout, check=True)
    return ":".join(str(into / p) for p in PACKAGES)


async def main(old_rev: str, rounds: int, conc: int, seconds: float, stream: bool = False) -> None:
    procs: list[subprocess.Popen[bytes]] = []
    with tempfile.TemporaryDirectory(prefix="llmgw-ab-") as tmp:
        old_path = export_tree(old_rev, Path(tmp) / "old")
        try:
            eng, eng_url = b.start_engine("--zero", "--slots", "4096")
            procs.append(eng)
            static = Path(tmp) / "static.yaml"
            h = hashlib.sha256(b.KEY.encode()).hexdigest()
            static.write_text(
                f"keys: [{{name: bench, hash: {h}}}]\nmodels:\n  - {{name: bench, endpoints: [{eng_url}]}}\n"
            )
            routers: dict[str, tuple[subprocess.Popen[bytes], str]] = {}
            for name, pp in ((old_rev, old_path), ("working tree", None)):
                port = b.free_port()
                p = b.start_router(static, port, pp)
                procs.append(p)
                await b.wait_http(f"http://127.0.0.1:{port}/health")
                routers[name] = (p, f"http://127.0.0.1:{port}/v1/chat/completions")
            headers = {"Authorization": f"Bearer {b.KEY}", "Content-Type": "application/json"}
            cpu: dict[str, list[float]] = {n: [] for n in routers}
            rate: dict[str, list[float]] = {n: [] for n in routers}
            errors = dict.fromkeys(routers, 0)
            async with aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=0),
                headers=headers,
                timeout=aiohttp.ClientTimeout(total=b.CLIENT_TIMEOUT_S),
            ) as s:
                for _, url in routers.values():  # warm both
                    await b.closed_loop(s, url, stream, conc // 2, 0.5)
                names = list(routers)
                for i in range(rounds):
                    for name in names if i % 2 == 0 else reversed(names):
                        p, url = routers[name]
                        c0 = b.cpu_s(p.pid)
                        run = await b.closed_loop(s, url, stream, conc, seconds)
                        cpu[name].append((b.cpu_s(p.pid) - c0) * 1000 / max(run.ok, 1))
                        rate[name].append(run.rate)
                        errors[name] += run.errors
            for name in routers:
                print(
                    f"{name:>14}: router CPU ms/request min {min(cpu[name]):.3f} "
                    f"median {statistics.median(cpu[name]):.3f}; "
                    f"rps median {statistics.median(rate[name]):.0f}; errors {errors[name]}"
                )
            ratio = statistics.median(cpu["working tree"]) / statistics.median(cpu[old_rev])
            print(f"CPU per request, working tree / {old_rev}: {ratio:.2f}")
        finally:
            for p in procs:
                b.stop(p)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--old", required=True, help="the revision to compare the working tree with")
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--seconds", type=float, default=2.0)
    ap.add_argument("--stream", action="store_true", help="100-token streams instead of small answers")
    a = ap.parse_args()
    import uvloop

    uvloop.run(main(a.old, a.rounds, a.concurrency, a.seconds, a.stream))
