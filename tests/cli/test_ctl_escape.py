"""``llmgw ctl`` tables show control characters escaped: an engine's log line or a name that carries
terminal escapes (clear screen, OSC 8 hyperlinks) must not drive the operator's terminal (issue 11)."""

from __future__ import annotations

import pytest

from llmgw_cli.ctl_render import (
    render_diff,
    render_explain,
    render_models,
    render_nodes,
    render_replicas,
    table,
)
from llmgw_cli.ctl_status import render_status
from llmgw_common.ctl import (
    CatalogDiff,
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

CLEAR = "\x1b[2J"
LINK = "\x1b]8;;https://evil.example\x1b\\click\x1b]8;;\x1b\\"
BIDI = "\u202e"
EVIL = f"x{CLEAR}{LINK}{BIDI}\x07\r"

CASES = {
    "nodes": lambda: render_nodes(
        NodesReply(nodes=(NodeInfo(name=EVIL, state="ready", fabric=EVIL, unhealthy_reasons=(EVIL,)),))
    ),
    "replicas": lambda: render_replicas(
        ReplicasReply(
            replicas=(
                ReplicaInfo(
                    id="r1",
                    model=EVIL,
                    state="failed",
                    created=0.0,
                    shards=(ShardInfo(shard=0, node="n1", error=EVIL, log_tail=(EVIL, "plain")),),
                ),
            )
        )
    ),
    "models": lambda: render_models(ModelsReply(models=(ModelInfo(name=EVIL, engine="sim", reason=EVIL),))),
    "status": lambda: render_status(StatusReply(unplaceable=(UnplaceableInfo(model=EVIL, reason=EVIL),))),
    "explain": lambda: render_explain(
        ExplainReply(
            model=EVIL,
            placeable=False,
            summary=EVIL,
            nodes=(NodeVerdict(node=EVIL, ok=False, reasons=(EVIL,)),),
        )
    ),
    "diff": lambda: render_diff(CatalogDiff(added=(EVIL,), removed=(EVIL,))),
}


@pytest.mark.parametrize("which", sorted(CASES))
def test_renderers_show_control_characters_escaped(which: str) -> None:
    text = CASES[which]()
    assert not any(ch in text for ch in "\x1b\x07\r" + BIDI), repr(text)
    assert "x\\x1b[2J\\x1b]8;;https://evil.example\\x1b\\click" in text, text
    assert "\\u202e\\x07\\r" in text


def test_table_columns_align_on_what_is_shown() -> None:
    lines = table(["A", "B"], [["x\x1b", "1"], ["yyyyy", "2"]]).splitlines()
    assert lines[1] == "x\\x1b  1"
    assert lines[2] == "yyyyy  2"
