from __future__ import annotations

from pathlib import Path

import pytest

from llmgw_agent.settings import AgentSettings
from llmgw_cli import settings_doc
from llmgw_router.settings import RouterSettings
from llmgw_runtime.settings import BusSettings, load_settings


def test_env_lists_are_comma_separated(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LLMGW_NATS_URLS", "nats://a:1, nats://b:2")
    monkeypatch.setenv("LLMGW_AUTH_EXEMPT", "/,/health")
    monkeypatch.setenv("LLMGW_MODEL_DIRS", "/m1:/m2")
    monkeypatch.setenv("LLMGW_LABELS", '{"role": "coding"}')
    assert BusSettings().nats_urls == ["nats://a:1", "nats://b:2"]
    assert RouterSettings().auth_exempt == ["/", "/health"]
    a = AgentSettings()
    assert a.model_dirs == ["/m1", "/m2"] and a.labels == {"role": "coding"}


def test_env_wins_over_yaml_and_overrides_win_over_env(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    cfg = tmp_path / "c.yaml"
    cfg.write_text("prefix: fromyaml\nnats_urls: [nats://y:1]\nfabric: ib-z\n")
    monkeypatch.setenv("LLMGW_CONFIG", str(cfg))
    monkeypatch.setenv("LLMGW_PREFIX", "fromenv")
    a = load_settings(AgentSettings, node="n1", fabric=None)
    assert (a.prefix, a.nats_urls, a.fabric, a.node) == ("fromenv", ["nats://y:1"], "ib-z", "n1")
    assert load_settings(AgentSettings, prefix="fromcli").prefix == "fromcli"


def test_invalid_value_is_refused_with_its_name(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LLMGW_KV_REPLICAS", "9")
    with pytest.raises(ValueError, match="kv_replicas"):
        BusSettings()


def test_configuration_reference_is_current() -> None:
    doc = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"
    assert doc.read_text() == settings_doc.render(), (
        "docs/configuration.md is stale: python -m llmgw_cli.settings_doc > docs/configuration.md"
    )


def test_the_default_router_id_is_one_subject_token_on_a_dotted_hostname(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A router named after ``gpu1.example.com`` published its reports on ``...router.r-gpu1.example.com-<pid>
    .idle``, which the control plane's ``router.*.idle`` never matches: its idle and usage were lost."""
    from llmgw_common.names import check_token
    from llmgw_common.subjects import Subjects

    monkeypatch.setattr("socket.gethostname", lambda: "gpu1.example.com")
    rid = RouterSettings().router_id
    assert check_token(rid) == rid and "gpu1-example-com" in rid
    assert len(Subjects("llmgw").idle(rid).split(".")) == len(Subjects("llmgw").all_idle().split("."))


def test_a_router_id_that_is_not_a_subject_token_is_refused() -> None:
    with pytest.raises(ValueError, match="router_id"):
        RouterSettings(router_id="edge.1")
