"""Engine ports: unique per node address, chosen deterministically from a seed.

Many simulated nodes share one address (127.0.0.1), so uniqueness is per address, not per node.
"""

from __future__ import annotations

import zlib
from collections.abc import Set as AbstractSet

from llmgw_common.errors import Refused
from llmgw_controlplane.scheduler.snapshot import Snapshot

PORT_LO = 20000
PORT_HI = 29999


class PortsExhausted(Refused, RuntimeError):
    """Every port of the range is taken on one address."""

    def __init__(self, lo: int, hi: int) -> None:
        self.lo = lo
        self.hi = hi
        super().__init__(f"no free port in {lo}-{hi}: all {hi - lo + 1} are in use")


def allocate_port(in_use: AbstractSet[int], *, seed: str, lo: int = PORT_LO, hi: int = PORT_HI) -> int:
    """A port in ``[lo, hi]`` not in ``in_use``: the seed's hash, then the next free one upwards.

    The same seed and the same ports in use give the same port, so a plan is reproducible.
    """
    if hi < lo:
        raise ValueError(f"empty port range {lo}-{hi}")
    span = hi - lo + 1
    start = zlib.crc32(seed.encode()) % span
    for i in range(span):
        port = lo + (start + i) % span
        if port not in in_use:
            return port
    raise PortsExhausted(lo, hi)


def ports_by_address(snap: Snapshot) -> dict[str, set[int]]:
    """Ports held by the snapshot's replicas, per node address (nodes of unknown address use the node name)."""
    out: dict[str, set[int]] = {}
    nodes = snap.nodes
    for r in snap.replicas:
        for s in r.shards:
            if not s.port:
                continue
            n = nodes.get(s.node)
            addr = n.address if n is not None else s.node
            out.setdefault(addr, set()).add(s.port)
    return out
