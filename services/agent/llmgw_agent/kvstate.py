"""A replica's followed blocks on disk, so that an agent restarted beside a running engine goes on
where it stopped: pure (bytes in, bytes out).

vLLM announces a block once, when it is cached; a prefix that stays cached (a system prompt) is never
announced again. An agent that restarted and started from nothing would never learn it. So the relay
keeps, beside each engine's socket, the engine's identity, its last sequence number and the engine
hash -> llmgw key of every block (:class:`~llmgw_agent.kvtranslate.ReplicaBlocks`), and on restart
loads it when the engine is the same process, then asks vLLM to replay the batches after that
sequence number (its replay socket keeps the last 10,000). A batch lost between the two shows as a
gap, which clears the replica as any gap does: never a wrong entry.
"""

from __future__ import annotations

from typing import Any

import msgpack

from llmgw_agent.kvtranslate import ReplicaBlocks

VERSION = 1


def dump(engine: str, blocks: ReplicaBlocks) -> bytes:
    hashes = list(blocks.by_hash)
    out: bytes = msgpack.packb(
        {
            "v": VERSION,
            "engine": engine,
            "seq": blocks.last_seq,
            "block_size": blocks.block_size,
            "group": blocks.group,
            "hashes": hashes,
            "keys": [blocks.by_hash[h] for h in hashes],
        }
    )
    return out


def load(data: bytes, engine: str) -> ReplicaBlocks | None:
    """The saved blocks when they are this engine's and well formed; None otherwise (start anew)."""
    try:
        d: Any = msgpack.unpackb(data, strict_map_key=False)
    except (ValueError, TypeError, msgpack.UnpackException):
        return None
    if not isinstance(d, dict) or d.get("v") != VERSION or d.get("engine") != engine:
        return None
    seq, size, group, hashes, keys = (d.get(k) for k in ("seq", "block_size", "group", "hashes", "keys"))
    if not (
        isinstance(seq, int)
        and (size is None or isinstance(size, int))
        and (group is None or isinstance(group, int))
        and isinstance(hashes, list)
        and isinstance(keys, list)
        and len(hashes) == len(keys)
        and all(isinstance(x, int) and not isinstance(x, bool) for x in (*hashes, *keys))
    ):
        return None
    r = ReplicaBlocks(block_size=size, last_seq=seq, group=group)
    for h, k in zip(hashes, keys, strict=True):
        r.by_hash[h] = k
        r.refs[k] = r.refs.get(k, 0) + 1
    return r
