"""Two routers' answers side by side: a revision's and the working tree's, for the same requests.

Every combination of method, path (known, unknown, odd), key (none, good, wrong) and body (none, not
JSON, a good chat, an unavailable model, an unknown model, not an object) goes to both; status, error
body (or its kind), Retry-After and Content-Type must be equal. Used when the router's HTTP server was
replaced (issue 15): 1,920 requests, no difference but the models' ``created`` (each router's start).

    .venv/bin/python bench/router_parity.py --old 6662540
"""

from __future__ import annotations

import argparse
import hashlib
import itertools
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent))
import router_ab
import router_overhead as b


def _kind(path: str, data: bytes) -> Any:
    try:
        j = json.loads(data)
    except ValueError:
        return "page" if path.split("?")[0] == "/" else ("bytes", len(data))
    if isinstance(j, dict):
        if j.get("object") == "chat.completion":
            return "chat-ok"
        if j.get("object") == "list":
            return "list"
        j.pop("created", None)  # each router's own start time
    return j


async def main(old_rev: str) -> int:
    tmp = Path(tempfile.mkdtemp(prefix="llmgw-parity-"))
    old = router_ab.export_tree(old_rev, tmp / "old")
    eng, eng_url = b.start_engine("--zero", "--slots", "4096")
    static = tmp / "s.yaml"
    h = hashlib.sha256(b.KEY.encode()).hexdigest()
    static.write_text(
        f"keys: [{{name: bench, hash: {h}}}]\nmodels:\n  - {{name: bench, endpoints: [{eng_url}]}}\n  - {{name: down, endpoints: []}}\n"
    )
    procs = [eng]
    urls = {}
    for name, pp in (("old", old), ("new", None)):
        port = b.free_port()
        p = b.start_router(static, port, pp)
        procs.append(p)
        await b.wait_http(f"http://127.0.0.1:{port}/health")
        urls[name] = f"http://127.0.0.1:{port}"
    methods = ["GET", "POST", "PUT", "DELETE", "HEAD", "OPTIONS", "PATCH"]
    paths = [
        "/",
        "/health",
        "/healthz",
        "/v1/models",
        "/v1/models/bench",
        "/v1/models/nope",
        "/v1/models/",
        "/v1/chat/completions",
        "/v1/completions",
        "/v1/embeddings",
        "/nothing",
        "/health/",
        "//",
        "/v1/",
        "/v1/models/org/x",
        "/?x=1",
        "/v1/models?x=1",
        "/%761/models",
        "/v1/chat/completions/",
        "/static/../v1/models",
    ]
    keys = [None, b.KEY, "llmgw-wrong"]
    bodies = [
        None,
        b"{not json",
        json.dumps(
            {"model": "bench", "messages": [{"role": "user", "content": "x"}], "max_tokens": 2}
        ).encode(),
        json.dumps({"model": "down", "messages": []}).encode(),
        json.dumps({"model": "nope"}).encode(),
        b"[1]",
    ]
    diffs = n = 0
    async with aiohttp.ClientSession() as s:
        for m, path, key, body in itertools.product(methods, paths, keys, bodies):
            if body is not None and m in ("GET", "HEAD"):
                continue
            out = {}
            for name, base in urls.items():
                hdrs = {"Authorization": f"Bearer {key}"} if key else {}
                async with s.request(
                    m,
                    base + path,
                    headers=hdrs,
                    data=body,
                ) as r:
                    data = await r.read()
                    out[name] = (
                        r.status,
                        _kind(path, data),
                        r.headers.get("Retry-After"),
                        r.headers.get("Content-Type", "").split(";")[0],
                    )
            n += 1
            if out["old"] != out["new"]:
                diffs += 1
                print(
                    "DIFF",
                    m,
                    path,
                    key and key[:8],
                    body and body[:20],
                    "\n  old",
                    out["old"],
                    "\n  new",
                    out["new"],
                )
    print("compared", n, "differences", diffs)
    for p in procs:
        b.stop(p)
    return 1 if diffs else 0


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--old", required=True, help="the revision to compare the working tree with")
    import uvloop

    sys.exit(uvloop.run(main(ap.parse_args().old)))
