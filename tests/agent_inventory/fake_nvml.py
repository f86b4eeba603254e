"""A fake NVML at the pynvml function boundary, built from a JSON machine fixture.

It implements exactly the pynvml functions :mod:`llmgw_agent.gpus` calls, with pynvml's own
argument conventions, return shapes and error classes (a lost GPU raises NVMLError_GpuIsLost on
every device call; an unsupported query raises NVMLError_NotSupported; an empty event set raises
NVMLError_Timeout; calls before nvmlInit raise NVMLError_Uninitialized).

Fixture shape (tests/fixtures/nvml/*.json): {"machine": str, "gpus": [{"name", "uuid",
"memory_total" (bytes), "ecc_uncorrected": {"volatile", "aggregate"} | "not_supported",
"retired_pages_pending": 0 | 1 | "not_supported", "remapped_rows": [corr, unc, pending, failure] |
"not_supported", "xids": [int] (critical XID events the driver raises), "lost": bool,
"device_error": "<Name>" (every device call raises NVMLError_<Name>)}]}. Any query's value may
also be "error:<Name>": that query raises NVMLError_<Name>.
"""

from __future__ import annotations

import json
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pynvml

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures" / "nvml"
NOT_SUPPORTED = "not_supported"


def _error(name: str) -> pynvml.NVMLError:
    cls: type[pynvml.NVMLError] = getattr(pynvml, f"NVMLError_{name}")
    return cls()


def load_machine(name: str) -> dict[str, Any]:
    machine: dict[str, Any] = json.loads((FIXTURES / f"{name}.json").read_text())
    return machine


@dataclass(frozen=True)
class FakeHandle:
    index: int


@dataclass
class FakeEventSet:
    queue: deque[SimpleNamespace] = field(default_factory=deque)
    registered: set[int] = field(default_factory=set)
    freed: bool = False


class FakeNvml:
    def __init__(self, machine: dict[str, Any], init_error: type[pynvml.NVMLError] | None = None) -> None:
        self.gpus: list[dict[str, Any]] = machine["gpus"]
        self.init_error = init_error
        self.inits = 0
        self.shutdowns = 0
        self.initialised = False
        self.event_sets: list[FakeEventSet] = []

    # ------------------------------------------------------------ test controls

    def raise_xid(self, index: int, xid: int) -> None:
        """The driver reports a critical XID on GPU ``index`` (seen by sets registered for it)."""
        for s in self.event_sets:
            if index in s.registered and not s.freed:
                s.queue.append(self._event(index, xid))

    def _event(self, index: int, xid: int) -> SimpleNamespace:
        return SimpleNamespace(
            device=FakeHandle(index),
            eventType=pynvml.nvmlEventTypeXidCriticalError,
            eventData=xid,
            gpuInstanceId=0xFFFFFFFF,
            computeInstanceId=0xFFFFFFFF,
        )

    # ------------------------------------------------------------ pynvml functions

    def _check(self) -> None:
        if not self.initialised:
            raise pynvml.NVMLError_Uninitialized()

    def _gpu(self, handle: FakeHandle) -> dict[str, Any]:
        self._check()
        if not isinstance(handle, FakeHandle) or not 0 <= handle.index < len(self.gpus):
            raise pynvml.NVMLError_InvalidArgument()
        gpu = self.gpus[handle.index]
        if gpu.get("lost"):
            raise pynvml.NVMLError_GpuIsLost()
        if gpu.get("device_error"):
            raise _error(gpu["device_error"])
        return gpu

    def _query(self, handle: FakeHandle, key: str) -> Any:
        value = self._gpu(handle)[key]
        if value == NOT_SUPPORTED:
            raise pynvml.NVMLError_NotSupported()
        if isinstance(value, str) and value.startswith("error:"):
            raise _error(value.removeprefix("error:"))
        return value

    def nvmlInit(self) -> None:
        self.inits += 1
        if self.init_error is not None:
            raise self.init_error()
        self.initialised = True

    def nvmlShutdown(self) -> None:
        self._check()
        self.shutdowns += 1
        self.initialised = False

    def nvmlDeviceGetCount(self) -> int:
        self._check()
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> FakeHandle:
        self._check()
        if not 0 <= index < len(self.gpus):
            raise pynvml.NVMLError_InvalidArgument()
        # The real call succeeds for a GPU that is lost; queries on the handle then fail.
        return FakeHandle(index)

    def nvmlDeviceGetName(self, handle: FakeHandle) -> str:
        return str(self._gpu(handle)["name"])

    def nvmlDeviceGetUUID(self, handle: FakeHandle) -> str:
        return str(self._gpu(handle)["uuid"])

    def nvmlDeviceGetMemoryInfo(self, handle: FakeHandle) -> SimpleNamespace:
        total = int(self._gpu(handle)["memory_total"])
        return SimpleNamespace(total=total, free=total, used=0)

    def nvmlDeviceGetTotalEccErrors(self, handle: FakeHandle, error_type: int, counter_type: int) -> int:
        ecc = self._query(handle, "ecc_uncorrected")
        if error_type != pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED:
            return 0
        key = {pynvml.NVML_VOLATILE_ECC: "volatile", pynvml.NVML_AGGREGATE_ECC: "aggregate"}.get(counter_type)
        if key is None:
            raise pynvml.NVMLError_InvalidArgument()
        return int(ecc[key])

    def nvmlDeviceGetRetiredPagesPendingStatus(self, handle: FakeHandle) -> int:
        return int(self._query(handle, "retired_pages_pending"))

    def nvmlDeviceGetRemappedRows(self, handle: FakeHandle) -> tuple[int, int, int, int]:
        corr, unc, pending, failure = (int(x) for x in self._query(handle, "remapped_rows"))
        return corr, unc, pending, failure

    def nvmlEventSetCreate(self) -> FakeEventSet:
        self._check()
        s = FakeEventSet()
        self.event_sets.append(s)
        return s

    def nvmlDeviceRegisterEvents(self, handle: FakeHandle, event_types: int, event_set: FakeEventSet) -> None:
        gpu = self._gpu(handle)
        if event_types & pynvml.nvmlEventTypeXidCriticalError:
            event_set.registered.add(handle.index)
            # The fixture's XIDs happen after the agent started listening.
            for xid in gpu.get("xids", ()):
                event_set.queue.append(self._event(handle.index, int(xid)))

    def nvmlEventSetWait(self, event_set: FakeEventSet, timeout_ms: int) -> SimpleNamespace:
        self._check()
        if event_set.freed:
            raise pynvml.NVMLError_InvalidArgument()
        if not event_set.queue:
            raise pynvml.NVMLError_Timeout()
        return event_set.queue.popleft()

    def nvmlEventSetFree(self, event_set: FakeEventSet) -> None:
        self._check()
        event_set.freed = True
