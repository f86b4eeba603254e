"""How `llmgw ctl status` shows scaling (issue 13): cold models, wakes in progress, the last cold start
of each model, the models that follow their load (issue 21) and the latest evictions. Nothing is printed
for a cluster that does not scale."""

from __future__ import annotations

from llmgw_common.ctl import StatusReply

# Evictions listed (the newest); `-o json` has all that are kept.
EVICTIONS_SHOWN = 5


def scaling_lines(s: StatusReply) -> list[str]:
    lines = []
    if s.cold:
        lines.append(f"cold (scaled to zero): {', '.join(s.cold)}")
    if s.waking:
        lines.append("waking: " + ", ".join(f"{m} ({what})" for m, what in sorted(s.waking.items())))
    if s.cold_starts:
        lines.append(
            "last cold start: " + ", ".join(f"{m} {t:.1f}s" for m, t in sorted(s.cold_starts.items()))
        )
    for f in s.scaling:
        # Issue 21: "m: 2 → 4 (waiting_per_replica 2): 4.5 waiting per replica over 2 for 40s: 2 → 4".
        count = f"{f.replicas} → {f.wants}" if f.wants != f.replicas else f"{f.replicas}"
        lines.append(f"follows load: {f.model} {count} replicas (target {f.target}): {f.why}")
    if s.evictions:
        lines.append(f"evictions: {len(s.evictions)} recent")
        for e in s.evictions[-EVICTIONS_SHOWN:]:
            where = ", ".join(e.nodes) or "-"
            lines.append(f"  evicted: {e.replica_id} of {e.model} on {where} for {e.for_model} ({e.reason})")
    return lines
