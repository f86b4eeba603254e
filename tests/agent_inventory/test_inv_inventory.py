"""collect_inventory: simulated nodes, memory (never 0 for unknown), engines, storage wiring."""

from __future__ import annotations

import logging
import os
import re
import stat
from pathlib import Path
from typing import Any

import pynvml
import pytest

from llmgw_agent.gpus import GpuProbe
from llmgw_agent.inventory import collect_inventory, count_cpus, parse_meminfo_gb, read_memory_gb
from llmgw_agent.settings import AgentSettings
from llmgw_agent.storage import WeightsCache
from llmgw_common.codec import decode, encode
from llmgw_common.gpuspec import parse_sim_gpus, sim_gpus
from llmgw_common.messages import Inventory
from tests.agent_inventory.fake_nvml import FakeNvml, load_machine
from tests.agent_inventory.weights_files import safetensors_bytes, write

MEMINFO = "MemTotal:       2113389016 kB\nMemFree:        1904121212 kB\nMemAvailable:   2001234567 kB\n"


def _settings(**kw: Any) -> AgentSettings:
    return AgentSettings(node="n1", **kw)


def _exe(path: Path) -> str:
    write(path, "#!/bin/sh\nexit 0\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return str(path)


@pytest.fixture
def meminfo(tmp_path: Path) -> str:
    return str(write(tmp_path / "meminfo", MEMINFO))


def test_simulated_node_with_an_unhealthy_gpu(meminfo: str) -> None:
    s = _settings(sim_gpus="8xH100-80GB", sim_unhealthy={3: "XID 79 seen"}, sim_memory_gb=1024, fabric="ib0",
                  labels={"zone": "a"}, address="10.1.2.3")  # fmt: skip
    inv = collect_inventory(s, "boot-1", 1000.0, meminfo_path=meminfo)
    assert inv.simulated and inv.engines == ("sim", "vllm", "llamacpp")
    assert (inv.node, inv.boot_id, inv.sent_at, inv.address, inv.fabric, inv.labels) == (
        "n1", "boot-1", 1000.0, "10.1.2.3", "ib0", {"zone": "a"},
    )  # fmt: skip
    assert [g.uuid for g in inv.gpus] == [f"GPU-sim-n1-{i}" for i in range(8)]
    assert {(g.gpu_class, g.memory_mb) for g in inv.gpus} == {("H100-80GB", 81920)}
    assert [(g.index, g.reasons) for g in inv.gpus if not g.healthy] == [(3, ("XID 79 seen",))]
    assert inv.memory_gb == 1024
    # Stable across restarts: same node, same UUIDs.
    assert collect_inventory(s, "boot-2", 1001.0, meminfo_path=meminfo).gpus == inv.gpus


def test_simulated_node_without_sim_memory_reports_the_real_one(meminfo: str) -> None:
    inv = collect_inventory(_settings(sim_gpus="1xL4-24GB"), "b", 0.0, meminfo_path=meminfo)
    assert inv.memory_gb == 2015.5 and inv.gpus[0].memory_mb == 24576


@pytest.mark.parametrize(
    ("spec", "expected"),
    [("8xH100-80GB", (8, "H100-80GB", 81920)), ("2 x A100-40GB", (2, "A100-40GB", 40960)),
     ("1XL4-24GB", (1, "L4-24GB", 24576)), ("0xH100-80GB", (0, "H100-80GB", 81920))],
)  # fmt: skip
def test_parse_sim_gpus(spec: str, expected: tuple[int, str, int]) -> None:
    assert parse_sim_gpus(spec) == expected


@pytest.mark.parametrize(
    ("spec", "unhealthy", "why"),
    [("H100-80GB", {}, "<count>x<CLASS>"), ("8xH100", {}, "end in its memory"),
     ("8xH100-80GB", {8: "XID 79"}, "names GPU 8, but sim_gpus '8xH100-80GB' has GPUs 0-7")],
)  # fmt: skip
def test_bad_sim_gpus_name_what_is_wrong(spec: str, unhealthy: dict[int, str], why: str) -> None:
    with pytest.raises(ValueError, match=re.escape(why)):
        sim_gpus("n1", spec, unhealthy)


def test_cpu_count_without_an_affinity_mask(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_affinity(pid: int) -> set[int]:
        raise OSError(38, "Function not implemented")

    monkeypatch.setattr(os, "sched_getaffinity", no_affinity)
    assert count_cpus() == os.cpu_count()


MEMINFO_CASES = [
    (MEMINFO, 2015.5),
    ("MemTotal: 16384000 kB\n", 15.6),
    ("MemFree: 1 kB\n", None),
    ("MemTotal: lots kB\n", None),
    ("MemTotal: 0 kB\n", None),
    ("MemTotal:\n", None),
    ("MemTotal: 1024 MB\n", None),
    ("", None),
]


@pytest.mark.parametrize(("text", "gb"), MEMINFO_CASES)
def test_parse_meminfo(text: str, gb: float | None) -> None:
    assert parse_meminfo_gb(text) == gb


def test_unreadable_meminfo_is_none_never_zero(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    missing = str(tmp_path / "nope")
    assert read_memory_gb(missing) is None
    inv = collect_inventory(_settings(), "b", 0.0, nvml=FakeNvml(load_machine("l4x1")), meminfo_path=missing)
    assert inv.memory_gb is None
    assert any("memory not reported" in r.getMessage() for r in caplog.records)
    # None survives the bus: a decoded report still says "not known".
    assert decode(encode(inv), Inventory).memory_gb is None


def test_real_meminfo_here() -> None:
    gb = read_memory_gb()
    assert gb is not None and gb > 0


def test_real_node_engines(tmp_path: Path, meminfo: str) -> None:
    llama, vllm = _exe(tmp_path / "bin" / "llama-server"), _exe(tmp_path / "bin" / "vllm")
    missing = str(tmp_path / "bin" / "absent")
    cpu = FakeNvml({"gpus": []}, init_error=pynvml.NVMLError_LibraryNotFound)
    gpu = FakeNvml(load_machine("h100x8"))
    cases = [
        (dict(llama_server=missing, vllm=missing), cpu, ("sim",)),
        (dict(llama_server=llama, vllm=vllm), cpu, ("sim", "llamacpp")),  # vLLM needs a GPU
        (dict(llama_server=missing, vllm=vllm), gpu, ("sim", "vllm")),
        (dict(llama_server=llama, vllm=vllm), gpu, ("sim", "llamacpp", "vllm")),
    ]
    for kw, nvml, engines in cases:
        inv = collect_inventory(_settings(**kw), "b", 0.0, nvml=nvml, meminfo_path=meminfo)
        assert inv.engines == engines, kw
        assert inv.simulated is False


def test_simulate_engines_on_a_real_node_offers_every_engine(tmp_path: Path, meminfo: str) -> None:
    s = _settings(simulate_engines=True, llama_server=str(tmp_path / "absent"), vllm=str(tmp_path / "absent"))
    inv = collect_inventory(s, "b", 0.0, nvml=FakeNvml(load_machine("l4x1")), meminfo_path=meminfo)
    assert inv.engines == ("sim", "vllm", "llamacpp") and inv.simulated is True
    assert [g.gpu_class for g in inv.gpus] == ["L4-24GB"]  # the GPUs are still the real ones


def test_real_node_with_nvml_gpus(meminfo: str) -> None:
    fake = FakeNvml(load_machine("a100x8_failing"))
    inv = collect_inventory(_settings(), "b", 0.0, nvml=fake, meminfo_path=meminfo)
    assert len(inv.gpus) == 8 and [g.index for g in inv.gpus if not g.healthy] == [3]
    assert fake.inits == fake.shutdowns == 1  # a probe opened for one call is closed after it
    assert inv.cpus is not None and inv.cpus >= 1
    assert inv.memory_gb == 2015.5


def test_agent_probe_says_no_nvml_once_across_calls(meminfo: str, caplog: pytest.LogCaptureFixture) -> None:
    probe = GpuProbe(nvml=FakeNvml({"gpus": []}, init_error=pynvml.NVMLError_DriverNotLoaded))
    with caplog.at_level(logging.INFO):
        first = collect_inventory(_settings(), "b", 0.0, probe=probe, meminfo_path=meminfo)
        second = collect_inventory(_settings(), "b", 60.0, probe=probe, meminfo_path=meminfo)
    probe.close()
    assert first.gpus == second.gpus == ()
    said = [r for r in caplog.records if "CPU node" in r.getMessage()]
    assert len(said) == 1


def test_storage_wiring(tmp_path: Path, meminfo: str) -> None:
    models = tmp_path / "models"
    write(models / "qwen" / "config.json", "{}")
    write(models / "qwen" / "model.safetensors", safetensors_bytes({"w": 4}))
    mountinfo = write(
        tmp_path / "mountinfo",
        f"22 1 259:2 / / rw - ext4 /dev/sda1 rw\n41 22 0:50 / {models} rw - nfs4 filer1:/export/models rw\n",
    )
    nvml = FakeNvml({"gpus": []})
    cache = WeightsCache()
    for _ in range(2):
        inv = collect_inventory(_settings(model_dirs=[str(models)]), "b", 0.0, nvml=nvml, meminfo_path=meminfo,
                                mountinfo_path=str(mountinfo), weights_cache=cache)  # fmt: skip
    assert cache.checks == 1  # the second collection reused the verdict
    assert inv.storage.looked
    assert [(w.name, w.shared, w.filer_id) for w in inv.storage.weights] == [
        ("qwen", True, "filer1:/export/models")
    ]
    not_looked = collect_inventory(_settings(), "b", 0.0, nvml=nvml, meminfo_path=meminfo)
    assert not_looked.storage.looked is False
    # model_dirs from the environment: a path list.
    os.environ["LLMGW_MODEL_DIRS"] = f"{models}{os.pathsep}{tmp_path / 'none'}"
    try:
        s = AgentSettings(node="n1")
    finally:
        del os.environ["LLMGW_MODEL_DIRS"]
    inv = collect_inventory(s, "b", 0.0, nvml=nvml, meminfo_path=meminfo, mountinfo_path=str(tmp_path / "x"))
    assert [(w.name, w.shared) for w in inv.storage.weights] == [("qwen", False)]  # no mount table: local
    assert len(inv.storage.problems) == 1 and str(tmp_path / "none") in inv.storage.problems[0]
