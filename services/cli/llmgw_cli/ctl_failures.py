"""How `llmgw ctl` shows failed replicas: the SHARDS/ERROR view of `ctl replicas --failed`, and the
one-line pointers under the `ctl replicas` and `ctl models` tables."""

from __future__ import annotations

from llmgw_common.ctl import ModelsReply, ReplicaInfo, ReplicasReply
from llmgw_common.durations import format_duration


def _ago(info: ReplicaInfo, now: float) -> str:
    return "-" if info.failed_at is None else format_duration(now - info.failed_at) + " ago"


def render_failure(info: ReplicaInfo, now: float) -> str:
    """One failed replica: when, why, then each shard with its error and its engine's last lines."""
    lines = [f"{info.id} ({info.model}) failed {_ago(info, now)}: {info.error or 'failed'}"]
    for s in info.shards:
        gpus = ",".join(map(str, s.gpus)) or "cpu"
        lines.append(
            f"  shard {s.shard} on {s.node} (gpus {gpus}, port {s.port}): {s.error or s.state or '-'}"
        )
        lines.extend(f"    | {line}" for line in s.log_tail)
    return "\n".join(lines)


def adapter_failures(reply: ReplicasReply) -> str:
    """LoRA adapters whose last load failed on a running replica (issue 33); empty when none."""
    lines = [
        f"  {r.id} ({r.model}) adapter {a}: {e}"
        for r in reply.replicas
        for a, e in sorted(r.adapter_errors.items())
    ]
    return "adapter loads failed:\n" + "\n".join(lines) if lines else ""


def render_failed(reply: ReplicasReply, now: float) -> str:
    adapters = adapter_failures(reply)
    if not reply.failed:
        kept = "no failed replica kept (failures are kept for a while after the replica is stopped)"
        return f"{kept}\n\n{adapters}" if adapters else kept
    return "\n\n".join([*(render_failure(f, now) for f in reply.failed), *([adapters] if adapters else [])])


def failed_note(reply: ReplicasReply, now: float) -> str:
    """A pointer under the replicas table; empty when no failure is kept."""
    if not reply.failed:
        return ""
    newest = reply.failed[0]
    return (
        f"\n{len(reply.failed)} failed replica(s) recently stopped, the last {_ago(newest, now)} "
        f"({newest.model}: {newest.error or 'failed'}); `llmgw ctl replicas --failed` for shards and logs"
    )


def models_failures(reply: ModelsReply, now: float) -> str:
    """Each model's last failure under the models table; empty when none is kept."""
    lines = [
        f"  {m.name}: {f.id} failed {_ago(f, now)}: {f.error or 'failed'}"
        for m in reply.models
        if (f := m.last_failure) is not None
    ]
    if not lines:
        return ""
    return "\nlast failures (`llmgw ctl replicas --failed` for logs):\n" + "\n".join(lines)
