"""Synthetic fleets for benches and tests: the inventories N simulated H100 nodes would publish.

One shape for every fleet-scale measure: ``bench/reconcile_scale.py`` (the pure reconcile),
``bench/ctl_large_replies.py`` and the tests of ctl answers at fleet scale.
"""

from __future__ import annotations

from llmgw_common.messages import GpuInfo, Inventory

GPU_CLASS = "H100-80GB"
GPU_MEMORY_MB = 81920
ENGINES = ("llamacpp", "sim", "vllm")


def synthetic_inventories(
    count: int, gpus_per_node: int = 8, nodes_per_fabric: int = 32, sent_at: float = 0.0
) -> list[Inventory]:
    """``count`` simulated nodes ``node-00000``… of ``gpus_per_node`` H100s, 1 TB of memory and 128
    CPUs each, grouped into fabrics of ``nodes_per_fabric``."""
    out = []
    for i in range(count):
        name = f"node-{i:05d}"
        out.append(
            Inventory(
                node=name,
                boot_id="boot-1",
                sent_at=sent_at,
                fabric=f"ib-{i // nodes_per_fabric:03d}",
                memory_gb=1024.0,
                cpus=128,
                engines=ENGINES,
                simulated=True,
                gpus=tuple(
                    GpuInfo(
                        index=g,
                        uuid=f"GPU-{name}-{g}",
                        name=GPU_CLASS,
                        gpu_class=GPU_CLASS,
                        memory_mb=GPU_MEMORY_MB,
                    )
                    for g in range(gpus_per_node)
                ),
            )
        )
    return out
