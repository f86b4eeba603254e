"""What this node is: its GPUs, memory, CPUs, storage and the engines it can run.

What the agent reports decides placement, so "not known" stays ``None`` and never becomes 0
(ARCHITECTURE #3), and storage that was not looked at says so (#4).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from llmgw_agent.engines import llama_server_path, vllm_command
from llmgw_agent.gpus import GpuProbe, NvmlApi
from llmgw_agent.settings import AgentSettings
from llmgw_agent.storage import WeightsCache, read_mounts, scan_model_dirs
from llmgw_common.gpuspec import sim_gpus
from llmgw_common.messages import GpuInfo, Inventory

log = logging.getLogger(__name__)

SIM_ENGINES: tuple[str, ...] = ("sim", "vllm", "llamacpp")


def parse_meminfo_gb(text: str) -> float | None:
    """MemTotal in GB (GiB, to 0.1) from /proc/meminfo text; None when absent or malformed."""
    for line in text.splitlines():
        if line.startswith("MemTotal:"):
            parts = line.split()
            try:
                kib = int(parts[1])
            except (IndexError, ValueError):
                return None
            if kib <= 0:
                return None
            unit = parts[2].lower() if len(parts) > 2 else "kb"
            if unit != "kb":
                return None
            return round(kib / (1024 * 1024), 1)
    return None


def read_memory_gb(path: str = "/proc/meminfo") -> float | None:
    """This machine's MemTotal in GB, or None when it cannot be read (never 0)."""
    try:
        return parse_meminfo_gb(Path(path).read_text())
    except OSError as e:
        log.warning("cannot read %s (%s): memory not reported", path, e)
        return None


def count_cpus() -> int | None:
    """CPUs this process may use (its affinity mask, which a container limits), or None."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count()


def available_engines(s: AgentSettings, gpus: tuple[GpuInfo, ...], simulated: bool) -> tuple[str, ...]:
    """Engines this node can run. A simulated node runs every engine as the simulator.

    On a real node: the simulator always, llama.cpp when its binary is on PATH, vLLM when its
    command's program is found and the node has GPUs, or says its vLLM is a CPU build
    (``vllm_cpu``: a GPU build refuses to run without a GPU).
    """
    if simulated:
        return SIM_ENGINES
    engines = ["sim"]
    if llama_server_path(s.llama_server):
        engines.append("llamacpp")
    if (gpus or s.vllm_cpu) and vllm_command(s.vllm):
        engines.append("vllm")
    return tuple(engines)


def collect_inventory(
    s: AgentSettings,
    boot_id: str,
    now: float,
    *,
    nvml: NvmlApi | None = None,
    probe: GpuProbe | None = None,
    weights_cache: WeightsCache | None = None,
    meminfo_path: str = "/proc/meminfo",
    mountinfo_path: str = "/proc/self/mountinfo",
) -> Inventory:
    """This node's inventory as of ``now``.

    Pass the same ``probe`` on every call (the agent keeps one for its life and closes it on exit):
    it holds the NVML session, the XIDs seen so far and the once-only "no NVML" log line. Without
    one, a probe over ``nvml`` (default: the pynvml module) is opened and closed for this call, so
    XIDs raised between calls are not seen and a CPU node says so on every call.

    A node is simulated when it has ``sim_gpus`` (GPUs and, if given, ``sim_memory_gb`` come from
    settings) or ``simulate_engines`` (every engine runs as the simulator, so all are offered).
    Likewise ``weights_cache`` keeps verdicts on unchanged model directories and GGUF files between
    calls (a GGUF check walks its whole vocabulary). Blocking (NVML, file system): call it from a
    worker thread in async code.
    """
    simulated = bool(s.sim_gpus) or s.simulate_engines
    if s.sim_gpus:
        gpus = sim_gpus(s.node, s.sim_gpus, s.sim_unhealthy)
    elif probe is not None:
        gpus = probe.read(s.gpu_class_overrides)
    else:
        once = GpuProbe(nvml=nvml, overrides=s.gpu_class_overrides)
        try:
            gpus = once.read()
        finally:
            once.close()
    if s.sim_gpus and s.sim_memory_gb is not None:
        memory_gb: float | None = s.sim_memory_gb
    else:
        memory_gb = read_memory_gb(meminfo_path)
    mounts = read_mounts(mountinfo_path) if s.model_dirs else ()
    storage = scan_model_dirs(s.model_dirs, mounts, cache=weights_cache)
    return Inventory(
        node=s.node,
        boot_id=boot_id,
        sent_at=now,
        address=s.address,
        gpus=gpus,
        memory_gb=memory_gb,
        cpus=count_cpus(),
        labels=dict(s.labels),
        fabric=s.fabric,
        engines=available_engines(s, gpus, simulated),
        storage=storage,
        simulated=simulated,
    )
