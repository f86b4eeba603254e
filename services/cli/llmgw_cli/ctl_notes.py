"""Notes printed under `llmgw ctl` tables: what a marker or a figure means, only when it appears."""

from __future__ import annotations

from llmgw_common.ctl import NodesReply


def nodes_legend(reply: NodesReply) -> str:
    """Lines under the nodes table: held cards, and simulated nodes (whose capacity is not real)."""
    lines = []
    if any(n.gpus_held for n in reply.nodes):
        lines.append(
            "held: healthy idle GPUs on a node that takes no new replica (cordoned, draining, unreachable, lost)"
        )
    sim = sum(1 for n in reply.nodes if n.simulated)
    if sim:
        lines.append(
            f"SIM: simulated node ({sim} of {len(reply.nodes)}): its GPUs are simulated, the capacity shown is not real"
        )
    return "".join("\n" + ln for ln in lines)
