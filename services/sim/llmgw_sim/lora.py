"""LoRA adapters of the simulated engine, as vLLM 0.32 serves them at run time (issue 33).

What vLLM does, and so what this does (checked on vLLM 0.32 for CPU with Gemma 3 270M; the source is
``vllm/entrypoints/openai/models/serving.py`` and ``vllm/v1/metrics``):

- An adapter is loaded by name and path and then served under its name, as a model whose ``parent`` is
  the base; unloaded, its name is an unknown model again (404). Requests already running go on.
- ``max_loras`` bounds the adapters with requests in one batch, not the adapters loaded: a request for
  another adapter waits (vLLM counts it waiting, "deferred") until one of them has no request left.
- ``max_cpu_loras`` (default ``max_loras``) adapters are held in memory, least recently used dropped; a
  dropped adapter stays loaded, and its next request reads it again (here: pays ``lora_load_s``).
- ``vllm:lora_requests_info`` is a gauge whose value is the time it was set, one series per label set
  ever seen (the newest is the current one); in 0.32 both ``running_lora_adapters`` and
  ``waiting_lora_adapters`` list every adapter with a request running or waiting.

:class:`Adapters` holds that state; the HTTP side is :mod:`llmgw_sim.lora_api`, the timing of a
request :meth:`Adapters.request`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path

from llmgw_common.errors import InvalidInput

# A series per label set seen, as vLLM keeps them; bounded here (vLLM's is not), so that a benchmark
# with many adapters does not grow every scrape without end. The newest are kept.
MAX_INFO_SERIES = 64
WEIGHT_FILES = ("adapter_model.safetensors", "adapter_model.bin")


@dataclass(frozen=True, slots=True)
class Adapter:
    name: str
    path: str


class LoadRefused(InvalidInput):
    """vLLM's refusal of a load or unload (the adapter asked for is wrong here): its status, error type
    and message."""

    def __init__(self, status: int, type_: str, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.type = type_


def read_rank(path: str) -> int:
    """An adapter directory's rank, read as vLLM reads it; :class:`LoadRefused` with vLLM's 404 when
    the directory holds no adapter (no ``adapter_config.json`` or no weights)."""
    d = Path(path)
    config = d / "adapter_config.json"
    try:
        data = json.loads(config.read_text())
        rank = int(data["r"])
    except (OSError, ValueError, KeyError, TypeError):
        raise _not_found_error() from None
    if not any((d / f).is_file() for f in WEIGHT_FILES):
        raise _not_found_error()
    return rank


def _not_found_error() -> LoadRefused:
    # vLLM 0.32 names neither the adapter's path nor the cause (the path is redacted to "<path>").
    return LoadRefused(404, "NotFoundError", "No adapter found for <path>")


class Adapters:
    """The adapters one engine serves: loaded, held in memory, and with requests."""

    def __init__(
        self,
        base: str,
        max_loras: int,
        capacity: int,
        *,
        max_rank: int = 16,
        load_s: float = 0.0,
        check_files: bool = False,
        wall: Callable[[], float],
    ) -> None:
        self.base = base
        self.max_loras = max_loras
        self.capacity = capacity
        self.max_rank = max_rank
        self.load_s = load_s
        self.check_files = check_files
        self._wall = wall
        # In load order, as vLLM lists them.
        self.loaded: dict[str, Adapter] = {}
        # Held in memory, least recently used first.
        self.resident: OrderedDict[str, None] = OrderedDict()
        # Adapter -> requests running or waiting; and -> those admitted to the batch. Insertion order is
        # the order vLLM's labels list them in.
        self.inflight: dict[str, int] = {}
        self.active: dict[str, int] = {}
        self._waiters: list[asyncio.Future[None]] = []
        self._locks: dict[str, asyncio.Lock] = {}
        self._series: dict[str, float] = {}
        self.loads = 0
        self.unloads = 0

    # ---------------------------------------------------------------- the runtime API

    def lookup(self, model: str) -> Adapter | None:
        return self.loaded.get(model)

    async def load(self, name: str, path: str, inplace: bool = False) -> None:
        """Load ``name`` from ``path`` (taking ``load_s``), or raise vLLM's refusal."""
        if not name or not path:
            raise LoadRefused(400, "InvalidUserInput", "Both 'lora_name' and 'lora_path' must be provided.")
        async with self._locks.setdefault(name, asyncio.Lock()):
            if name == self.base:
                raise LoadRefused(
                    400, "InvalidUserInput", f"The lora adapter '{name}' conflicts with a served base model."
                )
            if not inplace and name in self.loaded:
                raise LoadRefused(
                    400,
                    "InvalidUserInput",
                    f"The lora adapter '{name}' has already been loaded. If you want to load the adapter "
                    "in place, set 'load_inplace' to True.",
                )
            if self.check_files:
                try:
                    rank = read_rank(path)
                except LoadRefused as e:
                    raise LoadRefused(e.status, e.type, f"Loading lora {name} failed: {e}") from None
                if rank > self.max_rank:
                    raise LoadRefused(
                        500,
                        "InternalServerError",
                        f"Call to add_lora method failed: LoRA rank {rank} is greater than "
                        f"max_lora_rank {self.max_rank}.",
                    )
            if self.load_s > 0:
                await asyncio.sleep(self.load_s)
            self.loaded[name] = Adapter(name, path)
            self._hold(name)
            self.loads += 1

    def unload(self, name: str) -> None:
        if not name:
            raise LoadRefused(
                400, "InvalidUserInput", "'lora_name' needs to be provided to unload a LoRA adapter."
            )
        if name not in self.loaded:
            raise LoadRefused(404, "NotFoundError", f"The lora adapter '{name}' cannot be found.")
        del self.loaded[name]
        self.resident.pop(name, None)
        self.unloads += 1

    # ---------------------------------------------------------------- requests

    def _hold(self, name: str) -> bool:
        """Hold ``name`` in memory (most recently used); False when it was not held (read again).
        Over capacity, the least recently used adapter without requests in the batch is dropped."""
        held = name in self.resident
        self.resident[name] = None
        self.resident.move_to_end(name)
        while len(self.resident) > self.capacity:
            idle = next((n for n in self.resident if n not in self.active and n != name), None)
            if idle is None:
                break
            del self.resident[idle]
        return held

    def _admissible(self, name: str) -> bool:
        return name in self.active or len(self.active) < self.max_loras

    @contextlib.asynccontextmanager
    async def request(self, name: str) -> AsyncIterator[float]:
        """One request for adapter ``name`` from arrival to end: it waits while ``max_loras`` other
        adapters have requests in the batch; yields the seconds its start takes beyond the base's (an
        adapter no longer held in memory is read again)."""
        self.inflight[name] = self.inflight.get(name, 0) + 1
        admitted = False
        try:
            loop = asyncio.get_running_loop()
            while not self._admissible(name):
                fut: asyncio.Future[None] = loop.create_future()
                self._waiters.append(fut)
                await fut
            self.active[name] = self.active.get(name, 0) + 1
            admitted = True
            held = self._hold(name)
            yield 0.0 if held else self.load_s
        finally:
            if admitted:
                self._drop(self.active, name)
            self._drop(self.inflight, name)
            self._wake()

    @staticmethod
    def _drop(counts: dict[str, int], name: str) -> None:
        left = counts.get(name, 0) - 1
        if left > 0:
            counts[name] = left
        else:
            counts.pop(name, None)

    def _wake(self) -> None:
        waiters, self._waiters = self._waiters, []
        for fut in waiters:
            if not fut.done():
                fut.set_result(None)

    @property
    def waiting(self) -> int:
        """Requests held back because ``max_loras`` other adapters fill the batch."""
        return sum(self.inflight.values()) - sum(self.active.values())

    @property
    def busy(self) -> tuple[str, ...]:
        """Adapters with a request running or waiting, in vLLM's order (first request first)."""
        return tuple(self.inflight)

    def info_series(self) -> list[tuple[str, float]]:
        """``vllm:lora_requests_info``'s series as of now: (adapters label, time set), oldest first.
        The current label set is stamped now; earlier ones keep their time, as vLLM's do."""
        label = ",".join(self.busy)
        self._series.pop(label, None)
        self._series[label] = self._wall()
        while len(self._series) > MAX_INFO_SERIES:
            del self._series[next(iter(self._series))]
        return list(self._series.items())
