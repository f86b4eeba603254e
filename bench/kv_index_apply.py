"""What a router's KV index costs per block key it follows (issue 32), in process, side by side.

The firehose of ``bench/kv_firehose.py`` without the bus: 16 nodes x 2 replicas, batches of 3 requests
per node, each storing ``--new`` fresh keys and evicting as many once a replica holds 10,000. Half the
batches fill the index (untimed), the other half are decoded (``codec.decode``) and applied, in CPU time
(``time.process_time``), per key stored or removed. ``--baseline FILE`` loads another ``index.py`` (for
instance ``git show HEAD~1:services/router/llmgw_router/cache/index.py > /tmp/index_old.py``) and runs
it in turns with this tree's, so that a busy machine's slowdowns fall on both alike; both must end with
the same index.

    .venv/bin/python bench/kv_index_apply.py --baseline /tmp/index_old.py --rounds 5
"""

from __future__ import annotations

import argparse
import importlib.util
import random
import statistics
import sys
import time
from pathlib import Path
from types import ModuleType

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import llmgw_router.cache.index as current
from llmgw_common.codec import decode, encode
from llmgw_common.kvcache import KvDeltas, ReplicaKv

NODES, REPLICAS, CAPACITY, PER_BATCH = 16, 2, 10_000, 3


def load(path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location("baseline_index", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


def batches(new: int, count: int) -> list[bytes]:
    rng = random.Random(1)
    held: dict[str, list[int]] = {f"n{i}-r{j}": [] for i in range(NODES) for j in range(REPLICAS)}
    out: list[bytes] = []
    for seq in range(1, count + 1):
        for i in range(NODES):
            changes: dict[str, tuple[list[int], list[int]]] = {}
            for _ in range(PER_BATCH):
                r = f"n{i}-r{rng.randrange(REPLICAS)}"
                stored = [rng.getrandbits(64) for _ in range(new)]
                cache = held[r]
                removed = cache[: len(stored)] if len(cache) > CAPACITY else []
                del cache[: len(removed)]
                cache.extend(stored)
                s, rm = changes.setdefault(r, ([], []))
                s += stored
                rm += removed
            kvs = [
                ReplicaKv(replica=r, model="m", block_size=16, stored=s, removed=rm)
                for r, (s, rm) in changes.items()
            ]
            out.append(encode(KvDeltas(node=f"n{i}", stream="b", seq=seq, sent_at=0.0, replicas=kvs)))
    return out


def run(mod: ModuleType, warm: list[bytes], timed: list[bytes]) -> tuple[float, float, object]:
    """CPU seconds to decode and to apply ``timed`` after ``warm`` filled the index; the index."""
    idx = mod.KvIndex()
    for m in warm:
        for r in decode(m, KvDeltas).replicas:
            idx.apply(r)
    t = time.process_time()
    ds = [decode(m, KvDeltas) for m in timed]
    t_decode = time.process_time() - t
    t = time.process_time()
    for d in ds:
        for r in d.replicas:
            idx.apply(r)
    return t_decode, time.process_time() - t, idx


def main(a: argparse.Namespace) -> None:
    count = max(200, 120_000 // (PER_BATCH * a.new))
    msgs = batches(a.new, 2 * count)
    warm, timed = msgs[: len(msgs) // 2], msgs[len(msgs) // 2 :]
    keys = sum(len(r.stored) + len(r.removed) for m in timed for r in decode(m, KvDeltas).replicas)
    variants = [("this tree", current)] + ([("baseline", load(a.baseline))] if a.baseline else [])
    decode_ns: list[float] = []
    apply_ns: dict[str, list[float]] = {name: [] for name, _ in variants}
    ends: dict[str, object] = {}
    for _ in range(a.rounds):
        for name, mod in variants:
            td, ta, idx = run(mod, warm, timed)
            decode_ns.append(td / keys * 1e9)
            apply_ns[name].append(ta / keys * 1e9)
            ends[name] = idx
    if a.baseline:
        mine, base = ends["this tree"], ends["baseline"]
        assert mine._models["m"].blocks == base._models["m"].blocks, "the two indexes differ"  # type: ignore[attr-defined]
        assert mine.entries == base.entries  # type: ignore[attr-defined]
    print(f"command: {' '.join(sys.argv)}")
    print(
        f"{a.new} new keys a request, {keys:,} keys timed, {a.rounds} rounds; ns of CPU a key, median (min)"
    )
    print(f"  decode (codec.decode)  {statistics.median(decode_ns):6.0f} ({min(decode_ns):.0f})")
    for name, xs in apply_ns.items():
        print(f"  apply, {name:15s} {statistics.median(xs):6.0f} ({min(xs):.0f})")


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--new", type=int, default=125, help="fresh keys a request (125: 2,000 tokens, 16 a block)"
    )
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--baseline", type=Path, help="another index.py to run in turns with this tree's")
    main(p.parse_args())
