"""The simulated engine's options: one frozen value, built from a catalog mapping or from flags.

The agent builds a :class:`SimOptions` from a profile's ``options`` mapping, sets the port, model and
shard placement of the assignment, and starts ``llmgw sim-engine`` with :meth:`SimOptions.to_argv`; the
simulator parses the same flags back. It lives here, not in the simulator, because it is the contract
between the two: the agent never imports the simulator (an import-linter contract).
"""

from __future__ import annotations

import dataclasses
import sys
from dataclasses import dataclass, fields
from typing import Any

METRICS_STYLES = ("vllm", "llamacpp")
# vLLM registers its routes per runner: a pooling model has no chat route, a generate model no /pooling.
RUNNERS = ("generate", "pooling")
POOLING_TASKS = ("embed", "classify")
# The prefix cache's capacity without kv_tokens: 4096 blocks (64k tokens at 16 a block).
DEFAULT_CACHE_BLOCKS = 4096
# Where a KV-event publisher can bind (vLLM binds ipc:// and wildcard tcp://, and connects otherwise;
# the simulator always binds).
_ZMQ_SCHEMES = ("ipc://", "tcp://", "inproc://")


@dataclass(frozen=True, slots=True)
class SimOptions:
    port: int = 8000
    host: str = "127.0.0.1"
    model: str = "sim-model"
    # "vllm": vllm:num_requests_running/_waiting/kv_cache_usage_perc; "llamacpp": llamacpp:requests_*.
    metrics_style: str = "vllm"
    ttft_ms: float = 50.0
    tokens_per_s: float = 100.0
    slots: int = 8
    # KV-cache capacity in tokens; a running request holds its prompt plus max_tokens.
    # None: KV use is the share of slots taken.
    kv_tokens: int | None = None
    startup_s: float = 0.0
    fail_health: bool = False
    # Exit (code 3) after this many completed requests; None never.
    exit_after: int | None = None
    rank: int = 0
    world: int = 1
    # host:port of rank 0; required by followers (rank > 0).
    leader: str | None = None
    embedding_dims: int = 384
    # No delay at all, whatever ttft_ms and tokens_per_s say: for benchmarks.
    zero: bool = False
    # Completion length when the request does not give max_tokens.
    default_max_tokens: int = 16
    # Followers heartbeat the leader this often; the leader drops one silent for 4 heartbeats.
    heartbeat_s: float = 0.5
    # Act as vLLM's "generate" or "pooling" runner, serving only that runner's routes (others are
    # vLLM's bare 404); None serves every endpoint, so a dev cluster's one model answers any client.
    runner: str | None = None
    # A pooling runner's task: "embed" (embeddings, score, rerank) or "classify" (/classify).
    pooling_task: str = "embed"
    # Labels of a classify model; with exactly one, vLLM also serves score and rerank.
    num_labels: int = 2
    # A generate runner that also transcribes and translates audio (a Whisper-like model).
    transcription: bool = False
    # Keep Responses API answers with store=true (vLLM's VLLM_ENABLE_RESPONSES_API_STORE=1), at most
    # this many (least recently used dropped); 0 ignores store, as vLLM does by default.
    responses_store: int = 4096
    max_model_len: int = 32768
    # vLLM's --enable-prefix-caching: a block LRU (llmgw_sim.prefix_cache) of block_size tokens holding
    # kv_tokens // block_size blocks (DEFAULT_CACHE_BLOCKS without kv_tokens). Implied by
    # kv_events_endpoint. Off, no prompt is tokenized and every timing is as before.
    prefix_caching: bool = False
    # Tokens per KV block: vLLM's --block-size (16 on GPUs, 128 on CPU).
    block_size: int = 16
    # Prefill speed: the first token comes ttft_ms + (uncached prompt tokens / this) after the start.
    # None: ttft_ms alone, whatever the prompt.
    prefill_tokens_per_s: float | None = None
    # Bind a ZMQ PUB socket here (ipc://path, tcp://host:port) and publish vLLM's KV-cache events.
    kv_events_endpoint: str | None = None
    kv_events_topic: str = "kv-events"
    # LoRA adapters as vLLM serves them at run time (issue 33; llmgw_sim.lora). max_loras set: the
    # runtime API (/v1/load_lora_adapter, /v1/unload_lora_adapter) is served, and at most this many
    # adapters have requests in one batch (a request for another waits). None: no LoRA (those routes are
    # vLLM's bare 404). max_lora_rank: a larger adapter fails to load (read only with lora_check_files).
    # max_cpu_loras: adapters held in memory (vLLM's default: max_loras); more may be loaded, and one
    # not held is read again by its next request, which pays lora_load_s, as its first load did.
    max_loras: int | None = None
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None
    lora_load_s: float = 0.0
    # Read an adapter's directory as vLLM does (adapter_config.json with its rank, and weights): a path
    # without them fails its load with vLLM's error. Off: any path loads (simulated weights, as the
    # simulated model's are).
    lora_check_files: bool = False

    def __post_init__(self) -> None:
        problems = self.problems()
        if problems:
            raise ValueError("sim-engine options: " + "; ".join(problems))

    def problems(self) -> list[str]:
        out: list[str] = []
        if self.metrics_style not in METRICS_STYLES:
            out.append(f"metrics_style is {self.metrics_style!r}, must be one of {', '.join(METRICS_STYLES)}")
        if not 0 <= self.port <= 65535:
            out.append(f"port {self.port} is outside 0-65535")
        if self.ttft_ms < 0:
            out.append(f"ttft_ms is {self.ttft_ms}, must be >= 0")
        if self.tokens_per_s <= 0:
            out.append(f"tokens_per_s is {self.tokens_per_s}, must be > 0")
        if self.slots < 1:
            out.append(f"slots is {self.slots}, must be >= 1")
        if self.kv_tokens is not None and self.kv_tokens < 1:
            out.append(f"kv_tokens is {self.kv_tokens}, must be >= 1 (or unset)")
        if self.startup_s < 0:
            out.append(f"startup_s is {self.startup_s}, must be >= 0")
        if self.exit_after is not None and self.exit_after < 1:
            out.append(f"exit_after is {self.exit_after}, must be >= 1 (or unset)")
        if self.world < 1:
            out.append(f"world is {self.world}, must be >= 1")
        if not 0 <= self.rank < max(self.world, 1):
            out.append(f"rank {self.rank} is outside 0..{self.world - 1} for world {self.world}")
        if self.rank > 0 and not self.leader:
            out.append(f"rank {self.rank} is a follower and needs the leader's host:port")
        if self.leader is not None and not _is_host_port(self.leader):
            out.append(f"leader {self.leader!r} is not host:port")
        if self.embedding_dims < 1:
            out.append(f"embedding_dims is {self.embedding_dims}, must be >= 1")
        if self.default_max_tokens < 1:
            out.append(f"default_max_tokens is {self.default_max_tokens}, must be >= 1")
        if self.heartbeat_s <= 0:
            out.append(f"heartbeat_s is {self.heartbeat_s}, must be > 0")
        if self.runner is not None and self.runner not in RUNNERS:
            out.append(f"runner is {self.runner!r}, must be one of {', '.join(RUNNERS)} (or unset: all)")
        if self.pooling_task not in POOLING_TASKS:
            out.append(f"pooling_task is {self.pooling_task!r}, must be one of {', '.join(POOLING_TASKS)}")
        if self.num_labels < 1:
            out.append(f"num_labels is {self.num_labels}, must be >= 1")
        if self.responses_store < 0:
            out.append(f"responses_store is {self.responses_store}, must be >= 0")
        if self.max_model_len < 1:
            out.append(f"max_model_len is {self.max_model_len}, must be >= 1")
        if self.block_size < 1:
            out.append(f"block_size is {self.block_size}, must be >= 1")
        elif self.kv_tokens is not None and self.caches_prefixes and self.kv_tokens < self.block_size:
            out.append(f"kv_tokens {self.kv_tokens} is less than one block of {self.block_size}")
        if self.prefill_tokens_per_s is not None and self.prefill_tokens_per_s <= 0:
            out.append(f"prefill_tokens_per_s is {self.prefill_tokens_per_s}, must be > 0 (or unset)")
        if self.kv_events_endpoint is not None and not self.kv_events_endpoint.startswith(_ZMQ_SCHEMES):
            out.append(
                f"kv_events_endpoint {self.kv_events_endpoint!r} is not a ZMQ endpoint "
                f"({', '.join(s + '...' for s in _ZMQ_SCHEMES)})"
            )
        if self.max_loras is not None and self.max_loras < 1:
            out.append(f"max_loras is {self.max_loras}, must be >= 1 (or unset: no LoRA)")
        if self.max_lora_rank < 1:
            out.append(f"max_lora_rank is {self.max_lora_rank}, must be >= 1")
        if self.max_cpu_loras is not None:
            if self.max_loras is None:
                out.append("max_cpu_loras needs max_loras (LoRA is off without it)")
            elif self.max_cpu_loras < self.max_loras:
                # vLLM's LoRAConfig refuses it likewise.
                out.append(f"max_cpu_loras {self.max_cpu_loras} is less than max_loras {self.max_loras}")
        if self.lora_load_s < 0:
            out.append(f"lora_load_s is {self.lora_load_s}, must be >= 0")
        return out

    @property
    def serves_lora(self) -> bool:
        """Serves LoRA adapters (vLLM's --enable-lora with runtime updating)."""
        return self.max_loras is not None

    @property
    def lora_capacity(self) -> int:
        """Adapters held in memory at once: max_cpu_loras, else max_loras (0 without LoRA)."""
        if self.max_loras is None:
            return 0
        return self.max_cpu_loras if self.max_cpu_loras is not None else self.max_loras

    @property
    def caches_prefixes(self) -> bool:
        """Keeps a prefix cache: asked to, or to publish its events."""
        return self.prefix_caching or self.kv_events_endpoint is not None

    @property
    def cache_blocks(self) -> int:
        """The prefix cache's capacity in blocks."""
        if self.kv_tokens is not None:
            return max(self.kv_tokens // self.block_size, 1)
        return DEFAULT_CACHE_BLOCKS

    @property
    def is_follower(self) -> bool:
        return self.rank > 0

    @property
    def generates(self) -> bool:
        """Serves vLLM's generate routes (chat, completions, Responses, Messages)."""
        return self.runner != "pooling"

    @property
    def pools(self) -> bool:
        """Serves vLLM's pooling routes (/pooling, and embeddings, classify, score by task)."""
        return self.runner != "generate"

    def pools_for(self, task: str) -> bool:
        """Serves the pooling routes of ``task``: "embed", "classify" or "score"."""
        if not self.pools:
            return False
        if self.runner is None:
            return True
        if task == "score":
            return self.pooling_task == "embed" or self.num_labels == 1
        return self.pooling_task == task

    @property
    def transcribes(self) -> bool:
        return self.runner is None or (self.runner == "generate" and self.transcription)

    @classmethod
    def from_dict(cls, options: dict[str, Any]) -> SimOptions:
        """Build from a catalog profile's ``options`` mapping; unknown keys and bad values raise ValueError."""
        known = {f.name: f for f in fields(cls)}
        unknown = sorted(set(options) - set(known))
        if unknown:
            raise ValueError(
                f"sim-engine options: unknown option(s) {', '.join(unknown)} (known: {', '.join(sorted(known))})"
            )
        values: dict[str, Any] = {}
        for key, raw in options.items():
            values[key] = _coerce(key, str(known[key].type), raw)
        return cls(**values)

    def replace(self, **changes: Any) -> SimOptions:
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_argv(self) -> list[str]:
        """The flags of ``llmgw sim-engine`` (without the command itself) that reproduce these options."""
        argv: list[str] = []
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name in _ONLY_WHEN_SET and value == f.default:
                continue
            flag = "--" + f.name.replace("_", "-")
            if isinstance(value, bool):
                if value:
                    argv.append(flag)
            elif value is not None:
                argv += [flag, _fmt(value)]
        return argv

    def command(self, python: str = sys.executable) -> list[str]:
        """The whole command line that starts an engine with these options."""
        return [python, "-m", "llmgw_cli", "sim-engine", *self.to_argv()]


# The API-surface and prefix-cache options go on the command line only when a profile sets them: the argv of every
# other profile stays what it was (and within the flags of an older `llmgw sim-engine`).
_ONLY_WHEN_SET = frozenset(
    {
        "runner",
        "pooling_task",
        "num_labels",
        "transcription",
        "responses_store",
        "max_model_len",
        "block_size",
        "kv_events_topic",
        "max_lora_rank",
        "lora_load_s",
    }
)


def _fmt(value: object) -> str:
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)


def _is_host_port(s: str) -> bool:
    host, sep, port = s.rpartition(":")
    return bool(sep and host and port.isdigit() and 0 < int(port) <= 65535)


_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


def _coerce(key: str, type_name: str, raw: Any) -> Any:
    """Coerce a YAML value to the field's type; a value that does not fit names the option."""
    if raw is None:
        if "None" in type_name:
            return None
        raise ValueError(f"sim-engine options: {key} cannot be empty")
    try:
        if type_name.startswith("bool"):
            if isinstance(raw, bool):
                return raw
            if str(raw).lower() in _TRUE | _FALSE:
                return str(raw).lower() in _TRUE
            raise ValueError(raw)
        if type_name.startswith("int"):
            if isinstance(raw, bool) or (isinstance(raw, float) and not raw.is_integer()):
                raise ValueError(raw)
            return int(raw)
        if type_name.startswith("float"):
            if isinstance(raw, bool):
                raise ValueError(raw)
            return float(raw)
        return str(raw)
    except (TypeError, ValueError):
        kind = type_name.split(" ")[0]
        raise ValueError(f"sim-engine options: {key} is {raw!r}, expected {kind}") from None
