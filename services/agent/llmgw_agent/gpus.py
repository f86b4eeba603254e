"""GPUs as NVML sees them: identity, a GPU class, and health with reasons an operator can act on.

The seam is :data:`NvmlApi`: the ``pynvml`` module itself, or any object exposing the same function
names (tests build one from JSON fixtures). Errors are always ``pynvml.NVMLError`` subclasses, as the
real library raises them. No NVML library or no driver makes this a CPU node, said once per probe.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import pynvml

from llmgw_common.messages import GpuInfo

log = logging.getLogger(__name__)

# XIDs that an application causes (bad kernel, out-of-range access, a killed context, ...): the card
# is fine. Same set the NVIDIA Kubernetes device plugin skips; every other critical XID marks the GPU.
APPLICATION_XIDS: frozenset[int] = frozenset({13, 31, 43, 45, 68, 109})

# Errors that mean "this machine has no usable NVML", not "a GPU is broken".
_NO_NVML: tuple[type[BaseException], ...] = (
    pynvml.NVMLError_LibraryNotFound,
    pynvml.NVMLError_DriverNotLoaded,
    pynvml.NVMLError_FunctionNotFound,
    pynvml.NVMLError_LibRmVersionMismatch,
    pynvml.NVMLError_NoPermission,
)

# Memory sizes that GPUs are sold with (GB). NVML reports a little less than the marketed size (the
# driver reserves some, ECC takes some): 23034 MiB is an "L4 24GB", 81559 MiB an "H100 80GB".
MARKETED_GB: tuple[int, ...] = (
    2, 4, 6, 8, 10, 11, 12, 16, 20, 24, 32, 40, 48, 64, 80, 94, 96, 120, 128, 141, 144, 180, 192, 256, 288,
)  # fmt: skip

# Name tokens that say how the card is packaged or which memory it uses, not which GPU it is.
_PACKAGING = re.compile(
    r"^(SXM\d*|PCIE|NVL|NVLINK|HBM\d*E?|GDDR\d*X?|\d+GB|GPU|TENSOR|CORE|GENERATION|MIG.*|\d+C|\d+G)$"
)
_VENDOR = re.compile(r"^(NVIDIA|TESLA|GEFORCE|QUADRO)$")


class NvmlApi(Protocol):
    """The pynvml functions this module calls (the module satisfies it; so does a fake)."""

    def nvmlInit(self) -> None: ...
    def nvmlShutdown(self) -> None: ...
    def nvmlDeviceGetCount(self) -> int: ...
    def nvmlDeviceGetHandleByIndex(self, index: int) -> Any: ...
    def nvmlDeviceGetName(self, handle: Any) -> str | bytes: ...
    def nvmlDeviceGetUUID(self, handle: Any) -> str | bytes: ...
    def nvmlDeviceGetMemoryInfo(self, handle: Any) -> Any: ...
    def nvmlDeviceGetTotalEccErrors(self, handle: Any, error_type: int, counter_type: int) -> int: ...
    def nvmlDeviceGetRetiredPagesPendingStatus(self, handle: Any) -> int: ...
    def nvmlDeviceGetRemappedRows(self, handle: Any) -> tuple[int, int, int, int]: ...
    def nvmlEventSetCreate(self) -> Any: ...
    def nvmlDeviceRegisterEvents(self, handle: Any, event_types: int, event_set: Any) -> None: ...
    def nvmlEventSetWait(self, event_set: Any, timeout_ms: int) -> Any: ...
    def nvmlEventSetFree(self, event_set: Any) -> None: ...


def marketed_gb(memory_mb: int) -> int:
    """The marketed memory size of a card whose NVML total is ``memory_mb`` MiB."""
    gib = memory_mb / 1024
    for size in MARKETED_GB:
        # Half a percent of slack for a size reported a hair above the marketed one. No more: a
        # GH200's 95.6 GiB must stay a 96 GB card, not become a 94 GB one.
        if size >= gib * 0.995:
            return size
    return round(gib)


def model_token(name: str) -> str:
    """The GPU model in an NVML name: 'NVIDIA A100-SXM4-80GB' -> 'A100', 'NVIDIA GeForce RTX 4090' -> 'RTX4090'."""
    tokens = [t for t in re.split(r"[\s\-_]+", name.strip().upper()) if t]
    kept = [t for t in tokens if not _VENDOR.match(t) and not _PACKAGING.match(t)]
    return "".join(kept) or "GPU"


def gpu_class(name: str, memory_mb: int, overrides: Mapping[str, str] | None = None) -> str:
    """The class placement matches on: model and marketed memory ('H100-80GB'), unless overridden by name."""
    if overrides and name in overrides:
        return overrides[name]
    return f"{model_token(name)}-{marketed_gb(memory_mb)}GB"


def _text(value: str | bytes) -> str:
    # Older nvidia-ml-py releases return bytes for names and UUIDs.
    return value.decode(errors="replace") if isinstance(value, bytes) else value


@dataclass
class _Known:
    uuid: str
    name: str
    memory_mb: int


class GpuProbe:
    """Reads the node's GPUs through NVML, keeping what must outlive one read.

    The agent keeps one for its life and closes it on exit. Kept across reads: whether NVML was
    found (so a CPU node says so once, while still trying again in case a driver gets loaded), the
    XID event set and the XIDs seen so far (an XID is an event, gone once read: it stays on its GPU
    until the agent restarts), and each GPU's last known identity (so a GPU that is lost is still
    reported, as lost). Blocking: call it from a worker thread in async code.
    """

    def __init__(self, nvml: NvmlApi | None = None, overrides: Mapping[str, str] | None = None) -> None:
        self.nvml = nvml
        self.overrides: Mapping[str, str] = overrides or {}
        self._api: Any = None
        self._initialised = False
        self._said_no_nvml = False
        self._events: Any = None
        self._xids: dict[str, set[int]] = {}
        self._known: dict[int, _Known] = {}

    def _init(self) -> bool:
        if self._initialised:
            return True
        api: Any = self.nvml if self.nvml is not None else pynvml
        try:
            api.nvmlInit()
        except _NO_NVML as e:
            if not self._said_no_nvml:
                log.info("no NVML (%s): this is a CPU node", e)
                self._said_no_nvml = True
            return False
        except pynvml.NVMLError as e:
            if not self._said_no_nvml:
                log.warning("NVML failed to start (%s): reporting no GPUs", e)
                self._said_no_nvml = True
            return False
        self._api = api
        self._initialised = True
        self._said_no_nvml = False
        return True

    def close(self) -> None:
        """Free the event set and shut NVML down. Safe to call more than once."""
        if not self._initialised:
            return
        api = self._api
        if self._events is not None:
            try:
                api.nvmlEventSetFree(self._events)
            except pynvml.NVMLError as e:
                log.debug("freeing the NVML event set: %s", e)
            self._events = None
        try:
            api.nvmlShutdown()
        except pynvml.NVMLError as e:
            log.debug("NVML shutdown: %s", e)
        self._initialised = False

    def read(self, overrides: Mapping[str, str] | None = None) -> tuple[GpuInfo, ...]:
        """Every GPU of the node with its health; () on a CPU node.

        ``overrides`` (NVML name -> GPU class) replaces the probe's own for this read.
        """
        if overrides is not None:
            self.overrides = overrides
        if not self._init():
            return ()
        api = self._api
        try:
            count = int(api.nvmlDeviceGetCount())
        except pynvml.NVMLError as e:
            # NVML itself broke. A node that had GPUs still has them, but none can be trusted:
            # unhealthy GPUs are neither used nor free (ARCHITECTURE #2).
            log.warning("NVML could not count GPUs: %s", e)
            return tuple(
                GpuInfo(
                    index=i,
                    uuid=k.uuid,
                    name=k.name,
                    gpu_class=gpu_class(k.name, k.memory_mb, self.overrides),
                    memory_mb=k.memory_mb,
                    healthy=False,
                    reasons=(f"NVML failed: {e}",),
                )
                for i, k in sorted(self._known.items())
            )
        self._watch_xids(count)
        self._drain_xids()
        return tuple(self._read_one(i) for i in range(count))

    def _read_one(self, index: int) -> GpuInfo:
        api = self._api
        reasons: list[str] = []
        known = self._known.get(index)
        try:
            handle = api.nvmlDeviceGetHandleByIndex(index)
            uuid = _text(api.nvmlDeviceGetUUID(handle))
            name = _text(api.nvmlDeviceGetName(handle))
            memory_mb = int(api.nvmlDeviceGetMemoryInfo(handle).total) // (1024 * 1024)
        except pynvml.NVMLError as e:
            reasons.append(_device_error(e))
            if known is None:
                known = _Known(uuid=f"unknown-{index}", name="unknown", memory_mb=0)
            return GpuInfo(
                index=index,
                uuid=known.uuid,
                name=known.name,
                gpu_class=gpu_class(known.name, known.memory_mb, self.overrides)
                if known.memory_mb
                else "unknown",
                memory_mb=known.memory_mb,
                healthy=False,
                reasons=tuple(reasons),
            )
        self._known[index] = _Known(uuid=uuid, name=name, memory_mb=memory_mb)
        reasons.extend(_health(api, handle))
        reasons.extend(f"XID {x} seen" for x in sorted(self._xids.get(uuid, ())) if x not in APPLICATION_XIDS)
        return GpuInfo(
            index=index,
            uuid=uuid,
            name=name,
            gpu_class=gpu_class(name, memory_mb, self.overrides),
            memory_mb=memory_mb,
            healthy=not reasons,
            reasons=tuple(reasons),
        )

    def _watch_xids(self, count: int) -> None:
        """Register for critical XID events once; a GPU that cannot report them is not unhealthy."""
        if self._events is not None:
            return
        api = self._api
        try:
            self._events = api.nvmlEventSetCreate()
        except pynvml.NVMLError as e:
            log.info("NVML events unavailable, XIDs will not be seen: %s", e)
            return
        for i in range(count):
            try:
                handle = api.nvmlDeviceGetHandleByIndex(i)
                api.nvmlDeviceRegisterEvents(handle, pynvml.nvmlEventTypeXidCriticalError, self._events)
            except pynvml.NVMLError as e:
                log.info("GPU %d: XID events unavailable (%s)", i, e)

    def _drain_xids(self) -> None:
        if self._events is None:
            return
        api = self._api
        while True:
            try:
                data = api.nvmlEventSetWait(self._events, 0)
            except pynvml.NVMLError_Timeout:
                return
            except pynvml.NVMLError as e:
                # A lost GPU can make the wait itself fail; the device reads will say which one.
                log.debug("NVML event wait: %s", e)
                return
            if not int(data.eventType) & pynvml.nvmlEventTypeXidCriticalError:
                continue
            try:
                uuid = _text(api.nvmlDeviceGetUUID(data.device))
            except pynvml.NVMLError as e:
                log.warning("XID %d on a GPU NVML cannot name (%s)", int(data.eventData), e)
                continue
            xid = int(data.eventData)
            if xid not in self._xids.setdefault(uuid, set()):
                log.warning("GPU %s: XID %d", uuid, xid)
            self._xids[uuid].add(xid)


def _device_error(e: pynvml.NVMLError) -> str:
    if isinstance(e, pynvml.NVMLError_GpuIsLost):
        return f"GPU lost (NVML: {e})"
    if isinstance(e, pynvml.NVMLError_ResetRequired):
        return f"GPU needs a reset (NVML: {e})"
    return f"NVML cannot read the GPU: {e}"


def _health(api: Any, handle: Any) -> list[str]:
    """Reasons the GPU must not be used. A check the card does not support is not a failure."""
    reasons: list[str] = []
    try:
        ecc = int(
            api.nvmlDeviceGetTotalEccErrors(
                handle, pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, pynvml.NVML_VOLATILE_ECC
            )
        )
        if ecc > 0:
            reasons.append(f"uncorrectable ECC errors: {ecc}")
    except pynvml.NVMLError_NotSupported:
        pass
    except pynvml.NVMLError as e:
        reasons.append(_device_error(e))
    try:
        if int(api.nvmlDeviceGetRetiredPagesPendingStatus(handle)) == pynvml.NVML_FEATURE_ENABLED:
            reasons.append("retired pages pending")
    except pynvml.NVMLError_NotSupported:
        pass
    except pynvml.NVMLError as e:
        reasons.append(_device_error(e))
    try:
        _corr, _unc, pending, failure = api.nvmlDeviceGetRemappedRows(handle)
        if failure:
            reasons.append("row remapping failed")
        if pending:
            reasons.append("row remapping pending (reset needed)")
    except pynvml.NVMLError_NotSupported:
        pass
    except pynvml.NVMLError as e:
        reasons.append(_device_error(e))
    # The same lost GPU fails every query: say it once.
    return list(dict.fromkeys(reasons))
