"""GPUs through NVML, faked only at the pynvml function boundary with fixtures of real machines."""

from __future__ import annotations

import logging
from typing import Any

import pynvml
import pytest

from llmgw_agent.gpus import GpuProbe, gpu_class, marketed_gb, model_token
from tests.agent_inventory.fake_nvml import FakeNvml, load_machine


def _read(machine: dict[str, Any] | str) -> tuple[Any, ...]:
    fake = FakeNvml(load_machine(machine) if isinstance(machine, str) else machine)
    probe = GpuProbe(nvml=fake)
    try:
        return probe.read()
    finally:
        probe.close()


def test_h100_node_all_healthy() -> None:
    gpus = _read("h100x8")
    assert [g.index for g in gpus] == list(range(8))
    assert {g.gpu_class for g in gpus} == {"H100-80GB"}
    assert {g.memory_mb for g in gpus} == {81559}
    assert all(g.healthy and g.reasons == () for g in gpus)  # XID 13 on GPU 0 is the application's
    assert len({g.uuid for g in gpus}) == 8 and all(g.uuid.startswith("GPU-") for g in gpus)
    assert gpus[0].name == "NVIDIA H100 80GB HBM3"


def test_a100_node_with_one_failing_gpu() -> None:
    gpus = _read("a100x8_failing")
    assert {g.gpu_class for g in gpus} == {"A100-80GB"}
    assert [g.index for g in gpus if not g.healthy] == [3]
    assert gpus[3].reasons == ("uncorrectable ECC errors: 3", "row remapping pending (reset needed)")
    # Lifetime (aggregate) errors already dealt with do not condemn GPU 5.
    assert gpus[5].healthy


def test_l4_without_ecc_or_remapping_support_is_healthy() -> None:
    (gpu,) = _read("l4x1")
    assert (gpu.gpu_class, gpu.memory_mb, gpu.healthy) == ("L4-24GB", 23034, True)


def test_lost_retired_pages_and_xids() -> None:
    gpus = _read("v100x4_lost")
    assert gpus[0].healthy and gpus[0].gpu_class == "V100-32GB"
    assert gpus[1].healthy is False
    assert gpus[1].reasons == ("GPU lost (NVML: GPU is lost)",)
    assert gpus[1].uuid == "unknown-1" and gpus[1].gpu_class == "unknown"  # never seen before it was lost
    assert gpus[2].reasons == ("retired pages pending",)
    assert gpus[3].reasons == ("XID 48 seen", "XID 79 seen")


REASON_CASES: list[tuple[str, dict[str, Any], tuple[str, ...]]] = [
    ("ecc volatile", {"ecc_uncorrected": {"volatile": 1, "aggregate": 1}}, ("uncorrectable ECC errors: 1",)),
    ("remap failed", {"remapped_rows": [0, 5, 0, 1]}, ("row remapping failed",)),
    ("remap pending", {"remapped_rows": [0, 1, 1, 0]}, ("row remapping pending (reset needed)",)),
    ("retired pending", {"retired_pages_pending": 1}, ("retired pages pending",)),
    ("xid 79", {"xids": [79]}, ("XID 79 seen",)),
    ("xid 31 is the app's", {"xids": [31, 43]}, ()),
    ("all unsupported", {"ecc_uncorrected": "not_supported", "retired_pages_pending": "not_supported",
                         "remapped_rows": "not_supported"}, ()),
    ("lost", {"lost": True}, ("GPU lost (NVML: GPU is lost)",)),
    ("needs a reset", {"device_error": "ResetRequired"}, ("GPU needs a reset (NVML: GPU requires restart)",)),
    ("unreadable", {"device_error": "Unknown"}, ("NVML cannot read the GPU: Unknown Error",)),
    ("ecc query fails", {"ecc_uncorrected": "error:Unknown"}, ("NVML cannot read the GPU: Unknown Error",)),
    ("retired query fails", {"retired_pages_pending": "error:CorruptedInforom"},
     ("NVML cannot read the GPU: Corrupted infoROM",)),
    ("remap query lost", {"remapped_rows": "error:GpuIsLost"}, ("GPU lost (NVML: GPU is lost)",)),
    ("all queries lost, said once", {"ecc_uncorrected": "error:GpuIsLost", "retired_pages_pending": "error:GpuIsLost",
                                     "remapped_rows": "error:GpuIsLost"}, ("GPU lost (NVML: GPU is lost)",)),
]  # fmt: skip


@pytest.mark.parametrize(
    ("change", "reasons"), [(c, r) for _, c, r in REASON_CASES], ids=[c[0] for c in REASON_CASES]
)
def test_each_health_reason(change: dict[str, Any], reasons: tuple[str, ...]) -> None:
    machine = load_machine("h100x8")
    machine["gpus"][2].update(change)
    gpus = _read(machine)
    assert gpus[2].reasons == reasons
    assert gpus[2].healthy is (reasons == ())
    assert all(g.healthy for g in gpus if g.index != 2)


def test_xid_raised_after_start_is_seen_and_sticks() -> None:
    fake = FakeNvml(load_machine("h100x8"))
    probe = GpuProbe(nvml=fake)
    assert probe.read()[4].healthy
    fake.raise_xid(4, 79)
    assert probe.read()[4].reasons == ("XID 79 seen",)
    # An XID is an event, read once: it stays on the GPU until the agent restarts.
    assert probe.read()[4].reasons == ("XID 79 seen",)
    probe.close()
    assert fake.event_sets[0].freed and fake.shutdowns == 1 and fake.inits == 1


def test_gpu_lost_after_being_seen_keeps_its_identity() -> None:
    machine = load_machine("a100x8_failing")
    fake = FakeNvml(machine)
    probe = GpuProbe(nvml=fake, overrides={})
    before = probe.read()[6]
    machine["gpus"][6]["lost"] = True
    after = probe.read()[6]
    probe.close()
    assert (after.uuid, after.name, after.gpu_class, after.memory_mb) == (
        before.uuid, before.name, before.gpu_class, before.memory_mb,
    )  # fmt: skip
    assert after.healthy is False and after.reasons == ("GPU lost (NVML: GPU is lost)",)


class _CountFails(FakeNvml):
    fail_count = False

    def nvmlDeviceGetCount(self) -> int:
        if self.fail_count:
            raise pynvml.NVMLError_Unknown()
        return super().nvmlDeviceGetCount()


def test_nvml_breaking_after_start_marks_known_gpus_unhealthy() -> None:
    fake = _CountFails(load_machine("l4x1"))
    probe = GpuProbe(nvml=fake)
    assert probe.read()[0].healthy
    fake.fail_count = True
    (gpu,) = probe.read()
    probe.close()
    assert gpu.gpu_class == "L4-24GB" and gpu.healthy is False
    assert gpu.reasons == ("NVML failed: Unknown Error",)


@pytest.mark.parametrize(
    ("error", "said"),
    [(pynvml.NVMLError_LibraryNotFound, "CPU node"), (pynvml.NVMLError_DriverNotLoaded, "CPU node"),
     (pynvml.NVMLError_NoPermission, "CPU node"), (pynvml.NVMLError_Unknown, "NVML failed to start")],
)  # fmt: skip
def test_no_nvml_is_a_cpu_node_said_once(
    error: type[pynvml.NVMLError], said: str, caplog: pytest.LogCaptureFixture
) -> None:
    fake = FakeNvml({"gpus": []}, init_error=error)
    probe = GpuProbe(nvml=fake)
    with caplog.at_level(logging.INFO, logger="llmgw_agent.gpus"):
        assert probe.read() == ()
        assert probe.read() == ()
    probe.close()
    lines = [r.getMessage() for r in caplog.records if r.name == "llmgw_agent.gpus"]
    assert len(lines) == 1 and said in lines[0] and str(error()) in lines[0]
    assert fake.inits == 2  # tried again (a driver loaded later is found) without saying it again
    assert fake.shutdowns == 0


def test_no_nvml_then_driver_loaded() -> None:
    fake = FakeNvml(load_machine("l4x1"), init_error=pynvml.NVMLError_DriverNotLoaded)
    probe = GpuProbe(nvml=fake)
    assert probe.read() == ()
    fake.init_error = None
    assert [g.gpu_class for g in probe.read()] == ["L4-24GB"]
    probe.close()


def test_real_pynvml_without_a_driver_here() -> None:
    # This machine has no NVIDIA driver: the real library must say so, not crash.
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        pass
    else:
        pynvml.nvmlShutdown()
        pytest.skip("this machine has NVML")
    probe = GpuProbe()
    assert probe.read() == ()
    probe.close()


CLASS_CASES = [
    ("NVIDIA H100 80GB HBM3", 81559, "H100-80GB"),
    ("NVIDIA H100 PCIe", 81559, "H100-80GB"),
    ("NVIDIA H100 NVL", 95830, "H100-94GB"),
    ("NVIDIA H200", 143771, "H200-141GB"),
    ("NVIDIA A100-SXM4-80GB", 81920, "A100-80GB"),
    ("NVIDIA A100-SXM4-40GB", 40960, "A100-40GB"),
    ("NVIDIA A100-PCIE-40GB", 40536, "A100-40GB"),
    ("NVIDIA L4", 23034, "L4-24GB"),
    ("NVIDIA L40S", 46068, "L40S-48GB"),
    ("NVIDIA A10G", 23028, "A10G-24GB"),
    ("Tesla T4", 15360, "T4-16GB"),
    ("Tesla V100-SXM2-16GB", 16160, "V100-16GB"),
    ("Tesla V100-SXM2-32GB", 32768, "V100-32GB"),
    ("NVIDIA GeForce RTX 4090", 24564, "RTX4090-24GB"),
    ("NVIDIA RTX 6000 Ada Generation", 49140, "RTX6000ADA-48GB"),
    ("NVIDIA GH200 480GB", 97871, "GH200-96GB"),
    ("NVIDIA B200", 183359, "B200-180GB"),
    (b"NVIDIA L4".decode(), 23034, "L4-24GB"),
]


@pytest.mark.parametrize(("name", "mib", "cls"), CLASS_CASES, ids=[f"{c[0]}/{c[1]}" for c in CLASS_CASES])
def test_gpu_class_from_name_and_memory(name: str, mib: int, cls: str) -> None:
    assert gpu_class(name, mib) == cls


def test_gpu_class_override_by_exact_name() -> None:
    overrides = {"NVIDIA H100 80GB HBM3": "H100-SXM"}
    assert gpu_class("NVIDIA H100 80GB HBM3", 81559, overrides) == "H100-SXM"
    assert gpu_class("NVIDIA H100 PCIe", 81559, overrides) == "H100-80GB"
    fake = FakeNvml(load_machine("h100x8"))
    probe = GpuProbe(nvml=fake, overrides=overrides)
    assert {g.gpu_class for g in probe.read()} == {"H100-SXM"}
    probe.close()


def test_marketed_sizes_and_tokens() -> None:
    assert [marketed_gb(m) for m in (1024, 7680, 300 * 1024)] == [2, 8, 300]
    assert model_token("  ") == "GPU"


class _NoEvents(FakeNvml):
    def nvmlEventSetCreate(self) -> Any:
        raise pynvml.NVMLError_NotSupported()


class _BadTeardown(FakeNvml):
    def nvmlEventSetFree(self, event_set: Any) -> None:
        raise pynvml.NVMLError_Unknown()

    def nvmlShutdown(self) -> None:
        raise pynvml.NVMLError_Uninitialized()


class _WaitFails(FakeNvml):
    def nvmlEventSetWait(self, event_set: Any, timeout_ms: int) -> Any:
        raise pynvml.NVMLError_Unknown()


@pytest.mark.parametrize("fake_cls", [_NoEvents, _WaitFails])
def test_without_xid_events_gpus_are_still_read(fake_cls: type[FakeNvml]) -> None:
    machine = load_machine("h100x8")
    machine["gpus"][1]["xids"] = [79]
    probe = GpuProbe(nvml=fake_cls(machine))
    gpus = probe.read()
    probe.close()
    # The XID cannot be seen without events; the GPUs are still reported, and healthy.
    assert len(gpus) == 8 and all(g.healthy for g in gpus)


def test_close_survives_nvml_errors_and_is_idempotent() -> None:
    fake = _BadTeardown(load_machine("l4x1"))
    probe = GpuProbe(nvml=fake)
    assert len(probe.read()) == 1
    probe.close()
    probe.close()
    # Closed: the next read opens NVML again.
    assert len(probe.read()) == 1 and fake.inits == 2


def test_xid_on_a_gpu_lost_before_it_was_read(caplog: pytest.LogCaptureFixture) -> None:
    machine = load_machine("h100x8")
    fake = FakeNvml(machine)
    probe = GpuProbe(nvml=fake)
    probe.read()
    fake.raise_xid(6, 79)
    machine["gpus"][6]["lost"] = True
    with caplog.at_level(logging.WARNING, logger="llmgw_agent.gpus"):
        gpus = probe.read()
    probe.close()
    assert gpus[6].reasons == ("GPU lost (NVML: GPU is lost)",)
    assert any("XID 79 on a GPU NVML cannot name" in r.getMessage() for r in caplog.records)
