"""``llmgw ctl status``: the cluster on one screen at any fleet size (lists cut, lines clipped)."""

from __future__ import annotations

from collections.abc import Sequence

from llmgw_cli.ctl_render import shown, table
from llmgw_cli.ctl_scaling import scaling_lines
from llmgw_common.ctl import ClassCapacity, StatusReply
from llmgw_common.durations import format_duration


def usage_bar(c: ClassCapacity, width: int = 20) -> str:
    """``[###....xx-]``: used, free, unhealthy and held cards in proportion; a non-empty share shows."""
    if c.total <= 0:
        return "[" + " " * width + "]"
    parts = [(c.used, "#"), (c.unhealthy, "x"), (c.held, "-")]
    cells = {ch: (max(1, round(n * width / c.total)) if n else 0) for n, ch in parts}
    # Free takes what is left, so the bar is always ``width`` wide and a full class shows no free cell.
    taken = sum(cells.values())
    if taken > width:
        big = max(cells, key=lambda ch: cells[ch])
        cells[big] -= taken - width
        taken = width
    big = max(cells, key=lambda ch: cells[ch])
    if not c.free:
        cells[big] += width - taken  # rounding left a gap: the largest share takes it
        free = 0
    else:
        free = width - taken
        if free == 0:
            cells[big] -= 1
            free = 1
    return "[" + "#" * cells["#"] + "." * free + "x" * cells["x"] + "-" * cells["-"] + "]"


STATUS_LIST_MAX = 6
STATUS_WIDTH = 120


def _clip(line: str, width: int = STATUS_WIDTH) -> str:
    return line if len(line) <= width else line[: width - 3] + "..."


def _few(items: Sequence[str], where: str, most: int = 8) -> str:
    """``a, b, c and 12 more (see WHERE)``: the first ``most`` items and a count of the rest."""
    shown = ", ".join(items[:most])
    return shown if len(items) <= most else f"{shown} and {len(items) - most} more ({where})"


def _wrap_ids(ids: Sequence[str], max_lines: int = 3, width: int = STATUS_WIDTH) -> list[str]:
    """``ids`` in at most ``max_lines`` indented lines; the last says how many did not fit."""
    out: list[str] = []
    line = ""
    for i, rid in enumerate(ids):
        rest = len(ids) - i
        more = f" and {rest} more" if len(out) == max_lines - 1 else ""
        cand = f"{line}, {rid}" if line else f"  {rid}"
        # A line that is not the last ends with a comma: leave room for it.
        if len(cand) + max(len(more), 1) <= width or not line:
            line = cand
            continue
        if len(out) == max_lines - 1:
            return [*out, f"{line} and {rest} more"]
        out.append(line + ",")
        line = f"  {rid}"
    return [*out, line] if line else out


@shown
def render_status(s: StatusReply) -> str:
    lines = [f"leader: {'yes' if s.leader else 'no'} (fence {s.fence}), catalog v{s.catalog_version}"]
    lines.append("capacity (unhealthy GPUs are neither used nor free; held: idle on cordoned, draining,")
    lines.append("  unreachable or lost nodes; bar: # used, . free, x unhealthy, - held):")
    caps = [
        [c.gpu_class, str(c.total), str(c.used), str(c.free), str(c.unhealthy), str(c.held), usage_bar(c)]
        for c in s.capacity
    ]
    lines.append(_indent(table(["GPU CLASS", "TOTAL", "USED", "FREE", "UNHEALTHY", "HELD", "USAGE"], caps)))

    def kv(d: dict[str, int]) -> str:
        return ", ".join(f"{k} {v}" for k, v in sorted(d.items())) or "none"

    lines.append(f"free whole nodes per fabric: {kv(s.free_nodes_per_fabric)}")
    lines.append(f"nodes: {kv(s.nodes_by_state)}")
    lines.append(f"replicas: {kv(s.replicas_by_state)}")
    lines.append(f"models: {kv(s.models_by_state)}")
    # One screen at any fleet size: lists are cut to a few items, lines to a width, with where to see all.
    if s.unplaceable:
        lines.append(f"unplaceable: {len(s.unplaceable)} (why in full: `llmgw ctl explain-placement MODEL`)")
        lines.extend(_clip(f"  {u.model}: {u.reason}") for u in s.unplaceable[:STATUS_LIST_MAX])
        if len(s.unplaceable) > STATUS_LIST_MAX:
            lines.append(f"  and {len(s.unplaceable) - STATUS_LIST_MAX} more (`llmgw ctl models`)")
    idle = format_duration(s.idle_threshold_s)
    if s.idle_replicas:
        lines.append(f"idle for {idle} or more: {len(s.idle_replicas)} replica(s) (`llmgw ctl replicas`)")
        lines.extend(_wrap_ids(s.idle_replicas))
    else:
        lines.append(f"idle for {idle} or more: none known")
    if s.weights_per_fabric:
        lines.append("weights per fabric:")
        fabrics = list(s.weights_per_fabric.items())
        lines.extend(
            _clip(f"  {f}: {_few(w, '`llmgw ctl nodes -o json`')}") for f, w in fabrics[:STATUS_LIST_MAX]
        )
        if len(fabrics) > STATUS_LIST_MAX:
            lines.append(f"  and {len(fabrics) - STATUS_LIST_MAX} more fabrics")
    lines.extend(scaling_lines(s))
    lines.extend(f"warning: {w}" for w in s.warnings)
    return "\n".join(lines)


def _indent(text: str) -> str:
    return "\n".join("  " + line for line in text.splitlines())
