"""GPUs of a simulated node, from settings: '8xH100-80GB' with some marked unhealthy."""

from __future__ import annotations

from llmgw_common.gpuspec import parse_sim_gpus
from llmgw_common.messages import GpuInfo


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
