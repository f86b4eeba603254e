"""Control characters in names: refused at every entry, shown escaped in every sink (issue 11)."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError
from typer.testing import CliRunner

from llmgw_cli.fleet import FleetError, parse_fleet
from llmgw_cli.main import app as llmgw_app
from llmgw_common.catalog import CatalogError, parse_catalog
from llmgw_common.codec import DecodeError, decode, encode
from llmgw_common.messages import Heartbeat, Inventory, LoadReport, ShardState, ShardStatus
from llmgw_common.names import check_model_name, check_token, visible
from llmgw_common.subjects import check_token as subjects_check_token

# Terminal escapes, an OSC 8 hyperlink, Slack markup, a bidi override, a zero-width space, newlines.
HOSTILE = [
    "n1\n",
    "n1\r",
    "tiny2\n",
    "clear\x1b[2J",
    "\x1b]8;;https://evil\x1b\\click\x1b]8;;\x1b\\",
    "a\u202eb",
    "a\u200bb",
    "a\x00b",
    "a\x9bb",  # C1 CSI
    "a\u2028b",
]


@pytest.mark.parametrize("bad", HOSTILE)
def test_one_validator_refuses_control_characters_in_every_name(bad: str) -> None:
    with pytest.raises(ValueError, match="may contain only"):
        check_token(bad, "node name")
    with pytest.raises(ValueError, match="may contain only"):
        check_model_name(bad)
    assert subjects_check_token is check_token


@pytest.mark.parametrize("good", ["n1", "gpu-a_1"])
def test_plain_tokens_pass(good: str) -> None:
    assert check_token(good) == good and check_model_name(good) == good
    assert check_model_name("meta-llama/Llama-3.1-8B:q4.gguf")


def test_catalog_refuses_a_model_name_with_a_trailing_newline() -> None:
    with pytest.raises(CatalogError) as ei:
        parse_catalog({"models": [{"name": "tiny2\n", "engine": "sim"}]})
    (problem,) = ei.value.problems
    assert "may contain only" in problem and "\n" not in problem
    with pytest.raises(CatalogError, match="may contain only"):
        parse_catalog('models:\n  - {name: "clear\\e[2J", engine: sim}\n')


def test_fleet_refuses_node_names_with_control_characters() -> None:
    with pytest.raises(FleetError) as ei:
        parse_fleet({"nodes": [{"name": "n1\n"}, {"name": "x\x1b[2J"}, {"name": "ok", "fabric": "ib\n"}]})
    assert len(ei.value.problems) == 3, ei.value.problems
    assert all("\x1b" not in p and "\n" not in p for p in ei.value.problems)


def test_agent_settings_node_with_a_newline_is_bad_settings() -> None:
    r = CliRunner().invoke(llmgw_app, ["agent", "--node", "n1\n"])
    assert r.exit_code == 2, r.output
    assert "bad settings" in r.output and "node id 'n1\\n'" in r.output


NodeMessage = Heartbeat | Inventory | ShardStatus | LoadReport


@pytest.mark.parametrize("cls", [Heartbeat, Inventory, ShardStatus, LoadReport])
def test_bus_messages_naming_a_node_with_control_characters_do_not_decode(cls: type[NodeMessage]) -> None:
    by_class: dict[type[NodeMessage], dict[str, Any]] = {
        Heartbeat: dict(boot_id="b", seq=1, sent_at=1.0),
        Inventory: dict(boot_id="b", sent_at=1.0),
        ShardStatus: dict(
            boot_id="b", sent_at=1.0, replica_id="r", shard=0, model="m", state=ShardState.READY
        ),
        LoadReport: dict(sent_at=1.0),
    }
    fields = by_class[cls]
    good = encode(cls(node="n1", **fields))
    assert decode(good, cls).node == "n1"
    bad = encode(cls.model_construct(node="evil\x1b[2J", **fields))
    with pytest.raises(DecodeError, match="node name") as ei:
        decode(bad, cls)
    assert "\x1b" not in str(ei.value)
    with pytest.raises(ValidationError):
        cls(node="n1\n", **fields)


def test_visible_escapes_what_a_terminal_would_obey() -> None:
    assert visible("plain name-1 ünïcode 模型") == "plain name-1 ünïcode 模型"
    assert visible("a\x1b[2Jb") == "a\\x1b[2Jb"
    assert (
        visible("\x1b]8;;https://evil\x1b\\x\x1b]8;;\x1b\\")
        == "\\x1b]8;;https://evil\\x1b\\x\\x1b]8;;\\x1b\\"
    )
    assert visible("a\u202eb\u200b\x9b\x07") == "a\\u202eb\\u200b\\x9b\\x07"
    assert visible("one\ntwo\r") == "one\\ntwo\\r"
    assert visible("one\ntwo\r", keep="\n") == "one\ntwo\\r"


def test_service_logs_show_control_characters_escaped() -> None:
    import subprocess
    import sys

    code = (
        "import logging; from llmgw_runtime.runtime import setup_logging; setup_logging('INFO', 'svc'); "
        "logging.getLogger('llmgw.x').warning('node %s said\\nhi', 'evil\\x1b[2J\\u202e')"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30, check=True)
    assert "\x1b" not in r.stderr and "\u202e" not in r.stderr
    assert "node evil\\x1b[2J\\u202e said\nhi" in r.stderr


def test_a_model_name_has_a_length_limit() -> None:
    from llmgw_common.names import MAX_MODEL_NAME, check_model_name

    assert check_model_name("m" * MAX_MODEL_NAME)
    with pytest.raises(ValueError, match=f"longer than {MAX_MODEL_NAME}") as e:
        check_model_name("m" * 100_000)
    assert len(str(e.value)) < 300  # the refusal does not repeat the whole name
