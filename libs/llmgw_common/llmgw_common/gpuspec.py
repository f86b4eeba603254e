"""The simulated-GPU spec '8xH100-80GB', read one way by the agent (``sim_gpus``) and ``llmgw up``'s fleet file,
and the GPUs of a simulated node it gives (with some marked unhealthy)."""

from __future__ import annotations

import re

from llmgw_common.messages import GpuInfo

_SPEC = re.compile(r"^\s*(\d+)\s*[xX]\s*(\S+?)\s*$")
_MEMORY = re.compile(r"-(\d+(?:\.\d+)?)GB$", re.IGNORECASE)


def parse_sim_gpus(spec: str) -> tuple[int, str, int]:
    """(count, class, memory MiB) of a spec like '8xH100-80GB'; ValueError naming what is wrong."""
    m = _SPEC.match(spec)
    if not m:
        raise ValueError(f"sim_gpus {spec!r}: expected '<count>x<CLASS>', e.g. '8xH100-80GB'")
    count, cls = int(m.group(1)), m.group(2)
    mem = _MEMORY.search(cls)
    if not mem:
        raise ValueError(f"sim_gpus {spec!r}: the class must end in its memory, e.g. 'L4-24GB'")
    return count, cls, int(float(mem.group(1)) * 1024)


def sim_gpus(node: str, spec: str | None, unhealthy: dict[int, str]) -> tuple[GpuInfo, ...]:
    """The simulated GPUs of ``node``; UUIDs are stable per node and index across restarts."""
    if not spec:
        return ()
    count, cls, memory_mb = parse_sim_gpus(spec)
    beyond = sorted(i for i in unhealthy if not 0 <= i < count)
    if beyond:
        raise ValueError(f"sim_unhealthy names GPU {beyond[0]}, but sim_gpus {spec!r} has GPUs 0-{count - 1}")
    return tuple(
        GpuInfo(
            index=i,
            uuid=f"GPU-sim-{node}-{i}",
            name=f"Simulated {cls}",
            gpu_class=cls,
            memory_mb=memory_mb,
            healthy=i not in unhealthy,
            reasons=(unhealthy[i],) if i in unhealthy else (),
        )
        for i in range(count)
    )
