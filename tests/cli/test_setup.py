from __future__ import annotations

import asyncio
from pathlib import Path

import nats
import pytest
import yaml
from typer.testing import CliRunner

from llmgw_cli.main import app
from llmgw_common.codec import decode
from llmgw_common.messages import ClusterSettings
from llmgw_common.subjects import DESIRED_SETTINGS, Subjects
from llmgw_runtime.natsserver import NatsServer

runner = CliRunner()


def _settings(url: str, prefix: str) -> ClusterSettings:
    async def get() -> ClusterSettings:
        nc = await nats.connect(url)
        try:
            kv = await nc.jetstream().key_value(Subjects(prefix).bucket_desired)
            value = (await kv.get(DESIRED_SETTINGS)).value
            assert value is not None, "the settings key holds no value"
            return decode(value, ClusterSettings)
        finally:
            await nc.close()

    return asyncio.run(get())


def test_setup_writes_settings_file_and_stores_webhooks(
    nats_server: NatsServer, prefix: str, tmp_path: Path
) -> None:
    out = tmp_path / "llmgw.yaml"
    args = [
        "setup",
        "--no-input",
        "--nats",
        nats_server.url,
        "--prefix",
        prefix,
        "--fabric",
        "ib-a",
        "--out",
        str(out),
    ]
    r = runner.invoke(app, [*args, "--webhook", "http://127.0.0.1:9/a", "--webhook-format", "json"])
    assert r.exit_code == 0, r.output
    assert yaml.safe_load(out.read_text()) == {
        "nats_urls": [nats_server.url],
        "prefix": prefix,
        "fabric": "ib-a",
    }
    r = runner.invoke(app, [*args, "--webhook", "http://127.0.0.1:9/b"])
    assert r.exit_code == 0, r.output
    hooks = _settings(nats_server.url, prefix).webhooks
    assert [(h.url, h.format) for h in hooks] == [
        ("http://127.0.0.1:9/a", "json"),
        ("http://127.0.0.1:9/b", "slack"),
    ]
    r = runner.invoke(app, [*args, "--webhook", "http://127.0.0.1:9/c", "--replace-webhooks"])
    assert [h.url for h in _settings(nats_server.url, prefix).webhooks] == ["http://127.0.0.1:9/c"]


def test_setup_without_webhook_says_what_that_means(tmp_path: Path) -> None:
    r = runner.invoke(app, ["setup", "--no-input", "--out", str(tmp_path / "x.yaml")])
    assert r.exit_code == 0
    assert "nobody will be told" in r.output


def test_setup_refuses_unknown_webhook_format() -> None:
    r = runner.invoke(app, ["setup", "--no-input", "--webhook", "http://x", "--webhook-format", "xml"])
    assert r.exit_code == 1
    assert "neither slack nor json" in r.output


@pytest.mark.slow
def test_setup_names_the_unreachable_nats() -> None:
    r = runner.invoke(app, ["setup", "--no-input", "--nats", "nats://127.0.0.1:1", "--webhook", "http://x"])
    assert r.exit_code == 1
    assert "nats://127.0.0.1:1 did not answer" in r.output


def test_setup_generates_per_role_credentials(tmp_path: Path) -> None:
    auth, creds = tmp_path / "auth.conf", tmp_path / "creds"
    r = runner.invoke(
        app,
        [
            "setup",
            "--no-input",
            "--nats-auth",
            str(auth),
            "--nodes",
            "gpu-a1,gpu-b1",
            "--creds-dir",
            str(creds),
        ],
    )
    assert r.exit_code == 0, r.output
    text = auth.read_text()
    for user in ("controlplane", "admin", "router", "notifier", "agent-gpu-a1", "agent-gpu-b1"):
        assert f'user: "{user}"' in text
        role = yaml.safe_load((creds / f"{user}.yaml").read_text())
        assert role["nats_user"] == user and role["nats_password"] in text
    assert oct(auth.stat().st_mode & 0o777) == "0o600"


def test_setup_refuses_a_node_name_that_is_not_a_subject_token(tmp_path: Path) -> None:
    r = runner.invoke(app, ["setup", "--no-input", "--nats-auth", str(tmp_path / "a"), "--nodes", "bad.node"])
    assert r.exit_code == 1
    assert "node 'bad.node'" in r.output


def test_setup_auth_without_nodes_warns_that_no_agent_can_connect(tmp_path: Path) -> None:
    """The deploy configs require the generated file: one without agent users locks every agent out."""
    auth = tmp_path / "auth.conf"
    args = ["setup", "--no-input", "--nats-auth", str(auth), "--creds-dir", str(tmp_path / "c")]
    r = runner.invoke(app, args)
    assert r.exit_code == 0, r.output
    assert "warning: no --nodes: the file has no agent users, so no agent can connect" in r.output
    assert "agent-" not in auth.read_text()
    r = runner.invoke(app, [*args, "--nodes", "gpu-a1"])
    assert "warning: no --nodes" not in r.output


@pytest.mark.parametrize(
    ("url", "problem"),
    [
        ("hooks.slack.com/services/T/B/X", "needs http:// or https://"),
        ("ftp://example.com/hook", "needs http:// or https://"),
        ("http:///hook", "has no host"),
        ("http://[::1/hook", "is not a URL"),
        ("http://example.com:99999/hook", "is not a URL"),
    ],
)
def test_setup_refuses_a_webhook_that_is_not_an_http_url(url: str, problem: str) -> None:
    """Refused before anything is written: a URL no client can post to would be kept, every event given
    up on it, while `ctl status` no longer warns that nobody is told."""
    r = runner.invoke(app, ["setup", "--no-input", "--nats", "nats://127.0.0.1:1", "--webhook", url])
    assert r.exit_code == 1, r.output
    assert problem in r.output and "did not answer" not in r.output, r.output
