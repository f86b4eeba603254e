"""A fixed fleet for console tests: the ctl replies a control plane would give, as plain data.

Two fabrics, two GPU classes, one unhealthy GPU, a node without memory, a lost one, a cordoned and a
draining one; models ok, degraded, unplaceable and in a crash loop; a failed shard with a log tail;
idle times unknown, exact and a lower bound; and a few strings that would be markup if not escaped.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from llmgw_common.ctl import (
    ClassCapacity,
    DebugStatsReply,
    ExplainReply,
    ModelInfo,
    ModelsReply,
    NodeInfo,
    NodesReply,
    NodeVerdict,
    ReplicaInfo,
    ReplicasReply,
    ShardInfo,
    StatusReply,
    UnplaceableInfo,
)
from llmgw_common.messages import ClusterSettings, Webhook
from llmgw_controlplane.admin import SourceUnavailable
from llmgw_controlplane.console.usage import UsageRow, UsageView

NOW = 1_760_000_000.0
HOSTILE = '<script>alert("x")</script>'
HOSTILE_LOG = "<img src=x onerror=alert(1)> & done"
UNHEALTHY_REASON = "GPU 3: XID 79 (fell off the bus)"
UNPLACEABLE_REASON = "gpu-b01: has 0 free H100-80GB GPUs, needs 8; 3 nodes in fabric ib-b, needs 4"


def _node(name: str, **kw: object) -> NodeInfo:
    base: dict[str, object] = dict(
        name=name,
        state="ready",
        fabric="ib-a",
        gpu_summary="8xH100-80GB",
        gpus_total=8,
        gpus_used=0,
        gpus_free=8,
        memory_gb=1024.0,
        cpus=96,
        last_seen_s=1.2,
        storage_looked=True,
        labels={"rack": name[-2:]},
    )
    base.update(kw)
    return NodeInfo.model_validate(base)


NODES = (
    _node("gpu-a01", gpus_used=8, gpus_free=0, replicas=("r-llama70-1",), weights=("llama-70b",)),
    _node(
        "gpu-a02",
        gpus_used=4,
        gpus_free=3,
        gpus_unhealthy=1,
        unhealthy_reasons=(UNHEALTHY_REASON,),
        replicas=("r-mistral-1",),
    ),
    # A cordoned or lost node's idle cards are held, not free (the one count of views.gpu_buckets).
    _node("gpu-a03", cordoned=True, gpus_free=0, gpus_held=8, labels={"note": HOSTILE}),
    _node(
        "gpu-a04",
        draining=True,
        drain_deadline=NOW + 540,
        gpus_used=8,
        gpus_free=0,
        replicas=("r-llama70-2",),
    ),
    _node("gpu-b01", fabric="ib-b", gpu_summary="4xA100-40GB", gpus_total=4, gpus_free=4, memory_gb=None),
    _node(
        "gpu-b02",
        fabric="ib-b",
        gpu_summary="4xA100-40GB",
        gpus_total=4,
        gpus_used=1,
        gpus_free=3,
        replicas=("r-qwen-1",),
    ),
    _node(
        "gpu-b03",
        state="lost",
        fabric="ib-b",
        gpu_summary="4xA100-40GB",
        gpus_total=4,
        gpus_free=0,
        gpus_held=4,
        last_seen_s=340.0,
    ),
    _node("cpu-01", fabric=None, gpu_summary="", gpus_total=0, gpus_free=0, cpus=64, storage_looked=False),
)

STATUS = StatusReply(
    leader=True,
    fence=7,
    catalog_version=3,
    capacity=(
        ClassCapacity(gpu_class="A100-40GB", total=12, used=1, free=7, unhealthy=0, held=4),
        ClassCapacity(gpu_class="H100-80GB", total=32, used=20, free=3, unhealthy=1, held=8),
    ),
    free_nodes_per_fabric={"ib-b": 1},
    nodes_by_state={"ready": 7, "lost": 1},
    replicas_by_state={"ready": 3, "failed": 1},
    models_by_state={"ok": 1, "degraded": 1, "unplaceable": 1, "backoff": 1},
    unplaceable=(UnplaceableInfo(model="deepseek-671b", reason=UNPLACEABLE_REASON, since=NOW - 300),),
    idle_replicas=("r-qwen-1", "r-mistral-1"),
    idle_threshold_s=3600.0,
    weights_per_fabric={"ib-a": ("llama-70b", "mistral-7b"), "ib-b": ("qwen-7b",)},
    warnings=(
        "no webhook configured: node-lost and model-down events reach nobody (add one with `llmgw setup --webhook URL`)",
        "2 model(s) without a ready replica: deepseek-671b, gemma-crash",
    ),
)

MODELS = (
    ModelInfo(
        name="llama-70b",
        engine="vllm",
        gpu_class="H100-80GB",
        gpus_per_node=8,
        desired=2,
        ready=2,
        state="ok",
        watched=True,
    ),
    ModelInfo(
        name="mistral-7b",
        engine="vllm",
        gpu_class="H100-80GB",
        gpus_per_node=4,
        desired=2,
        ready=1,
        starting=1,
        state="degraded",
        reason="starting on gpu-a03",
    ),
    ModelInfo(
        name="deepseek-671b",
        engine="vllm",
        gpu_class="H100-80GB",
        gpus_per_node=8,
        nodes=4,
        desired=1,
        state="unplaceable",
        reason=UNPLACEABLE_REASON,
    ),
    ModelInfo(
        name="gemma-crash",
        engine="llamacpp",
        desired=1,
        failed=1,
        state="backoff",
        reason="crash loop: 3 failure(s), last: exit 1; next attempt in 40s",
    ),
)

REPLICAS = (
    ReplicaInfo(
        id="r-llama70-1",
        model="llama-70b",
        state="ready",
        created=NOW - 86400,
        shards=(ShardInfo(shard=0, node="gpu-a01", gpus=tuple(range(8)), port=20001, state="ready"),),
        endpoint="http://gpu-a01:20001",
        idle_s=12.0,
        idle_kind="exact",
        idle="12s",
    ),
    ReplicaInfo(
        id="r-llama70-2",
        model="llama-70b",
        state="ready",
        created=NOW - 7200,
        shards=(ShardInfo(shard=0, node="gpu-a04", gpus=tuple(range(8)), port=20002, state="ready"),),
        endpoint="http://gpu-a04:20002",
        draining=True,
        idle_s=-1.0,
        idle_kind="unknown",
        idle="-",
    ),
    ReplicaInfo(
        id="r-mistral-1",
        model="mistral-7b",
        state="ready",
        created=NOW - 90000,
        shards=(ShardInfo(shard=0, node="gpu-a02", gpus=(0, 1, 2, 3), port=20003, state="ready"),),
        endpoint="http://gpu-a02:20003",
        idle_s=7300.0,
        idle_kind="exact",
        idle="2h1m",
    ),
    ReplicaInfo(
        id="r-qwen-1",
        model="qwen-7b",
        state="ready",
        created=NOW - 300000,
        shards=(ShardInfo(shard=0, node="gpu-b02", gpus=(0,), port=20004, state="ready"),),
        endpoint="http://gpu-b02:20004",
        idle_s=259200.0,
        idle_kind="at_least",
        idle=">=3d",
    ),
    ReplicaInfo(
        id="r-gemma-1",
        model="gemma-crash",
        state="failed",
        created=NOW - 60,
        shards=(
            ShardInfo(
                shard=0,
                node="cpu-01",
                port=20005,
                state="failed",
                error="engine exited with code 1",
                log_tail=("loading model /models/gemma", HOSTILE_LOG, "error: out of memory"),
            ),
        ),
        idle="-",
    ),
)

EXPLAIN = ExplainReply(
    model="deepseek-671b",
    placeable=False,
    summary="needs 4 nodes x 8xH100-80GB in one fabric: no fabric has 4 free whole nodes",
    nodes=(
        NodeVerdict(node="gpu-a01", ok=False, reasons=("has 0 free H100-80GB GPUs, needs 8",)),
        NodeVerdict(node="gpu-a02", ok=False, reasons=("has 3 free H100-80GB GPUs, needs 8",)),
        NodeVerdict(node="gpu-a04", ok=False, reasons=("has 0 free H100-80GB GPUs, needs 8",)),
        NodeVerdict(node="gpu-a03", ok=False, reasons=("cordoned",)),
        NodeVerdict(node="gpu-b01", ok=False, reasons=("has no H100-80GB GPU",)),
    ),
)

USAGE = UsageView(
    routers=2,
    since=NOW - 3600,
    updated_at=NOW - 1,
    rows=(
        UsageRow("key-ops", "llama-70b", 1200, 2_400_000, 600_000),
        UsageRow("key-batch", "mistral-7b", 40, 8000, 2000),
        UsageRow(HOSTILE, "qwen-7b", 1, 10, 5),
    ),
)


@dataclass
class FixedSource:
    """A :class:`ConsoleSource` over fixed replies; ``fail`` makes every read raise SourceUnavailable."""

    status_reply: StatusReply = STATUS
    nodes_reply: NodesReply = field(default_factory=lambda: NodesReply(nodes=NODES))
    models_reply: ModelsReply = field(default_factory=lambda: ModelsReply(models=MODELS))
    replicas_reply: ReplicasReply = field(default_factory=lambda: ReplicasReply(replicas=REPLICAS))
    explains: dict[str, ExplainReply | None] = field(default_factory=lambda: {"deepseek-671b": EXPLAIN})
    cluster: ClusterSettings = field(default_factory=ClusterSettings)
    usage_view: UsageView | None = USAGE
    fail: str | None = None
    calls: list[str] = field(default_factory=list)

    def _read(self, what: str) -> None:
        self.calls.append(what)
        if self.fail is not None:
            raise SourceUnavailable(self.fail)

    async def status(self) -> StatusReply:
        self._read("status")
        return self.status_reply

    async def nodes(self) -> NodesReply:
        self._read("nodes")
        return self.nodes_reply

    async def models(self) -> ModelsReply:
        self._read("models")
        return self.models_reply

    async def replicas(self) -> ReplicasReply:
        self._read("replicas")
        return self.replicas_reply

    async def explain(self, model: str) -> ExplainReply | None:
        self._read("explain")
        return self.explains.get(model)

    async def settings(self) -> ClusterSettings:
        self._read("settings")
        return self.cluster

    async def usage(self) -> UsageView | None:
        self._read("usage")
        return self.usage_view

    async def debug_stats(self) -> DebugStatsReply:
        self._read("debug_stats")
        return DebugStatsReply(
            leader=True, fence=7, passes=42, last_pass_ms=1.5, nodes=len(NODES), replicas=len(REPLICAS)
        )


WEBHOOK = ClusterSettings(webhooks=(Webhook(url="https://hooks.example/T0", format="slack"),))
