"""`llmgw keys create/update/team/list` with limits, against a real nats-server: what the flags write
is the record routers read, bad flags exit 2 naming the problem, and a team record is not a key."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from llmgw_runtime.natsserver import NatsServer


def _cli(*args: str) -> tuple[int, str, str]:
    from llmgw_cli.main import app

    res = CliRunner().invoke(app, list(args))
    return res.exit_code, res.stdout, res.stderr


@pytest.mark.slow
def test_limits_set_on_create_changed_by_update_and_listed(nats_server: NatsServer, prefix: str) -> None:
    common = ["--nats", nats_server.url, "--prefix", prefix]
    code, out, err = _cli(
        "keys", "create", "--name", "batch", "--rpm", "60", "--tpm", "100000", "--daily-tokens", "2000000",
        "--model-limit", "llama:rpm=10,tpm=5000", "--weight", "0.5", "--team", "ml", *common,
    )  # fmt: skip
    assert code == 0, err
    assert out.strip().startswith("llmgw-") and "limits rpm=60,tpm=100000,daily-tokens=2000000" in err
    code, out, _ = _cli("keys", "list", "-o", "json", *common)
    row = json.loads(out)[0]
    assert row["limits"] == {
        "rpm": 60,
        "tpm": 100000,
        "daily_tokens": 2000000,
        "models": {"llama": {"rpm": 10, "tpm": 5000}},
    }
    assert (row["team"], row["weight"]) == ("ml", 0.5)
    # Update by name: one limit changed, one added, one model's replaced, the rest kept.
    code, out, err = _cli(
        "keys", "update", "batch", "--rpm", "120", "--concurrency", "8", "--model-limit", "llama:rpm=20",
        "--clear", "daily_tokens", *common,
    )  # fmt: skip
    assert code == 0, err
    assert "rpm=120,tpm=100000,concurrency=8 llama:rpm=20" in out and "team ml" in out
    code, out, _ = _cli("keys", "list", *common)
    header, line = out.splitlines()[:2]
    assert "TEAM" in header and "WEIGHT" in header and "LIMITS" in header
    assert "ml" in line and "0.5" in line and "rpm=120" in line
    # Everything cleared: unlimited again (None on the record, as a record from before tenancy).
    code, out, _ = _cli("keys", "update", "batch", "--clear", "rpm", "--clear", "tpm", "--clear",
                        "concurrency", "--clear", "models", "--team", "", "-o", "json", *common)  # fmt: skip
    row = json.loads(out)
    assert code == 0 and row["limits"] is None and row["team"] is None


@pytest.mark.slow
def test_bad_limit_flags_exit_2_naming_the_problem(nats_server: NatsServer, prefix: str) -> None:
    common = ["--nats", nats_server.url, "--prefix", prefix]
    for args, words in (
        (["--rpm", "0"], "rpm: must be at least 1"),
        (["--model-limit", "llama"], "expected MODEL:rpm=N"),
        (["--model-limit", "llama:rps=3"], "'rps=3' is not one of"),
        (["--weight", "0"], "--weight must be above 0"),
    ):
        code, _, err = _cli("keys", "create", "--name", "x", *args, *common)
        assert code == 2 and words in err, (args, err)
    code, _, err = _cli("keys", "update", "nobody", "--rpm", "5", *common)
    assert code == 1 and "no key with id or name 'nobody'" in err
    code, _, err = _cli("keys", "update", "x", "--clear", "speed", *common)
    assert code == 2 and "'speed' is not one of" in err


@pytest.mark.slow
def test_a_team_s_limits_are_set_shown_and_never_listed_as_a_key(
    nats_server: NatsServer, prefix: str
) -> None:
    common = ["--nats", nats_server.url, "--prefix", prefix]
    code, out, err = _cli("keys", "team", "ml", "--rpm", "100", "--monthly-tokens", "9000000", *common)
    assert code == 0 and "team ml: limits rpm=100,monthly-tokens=9000000" in out, err
    code, out, _ = _cli("keys", "team", "ml", "--tpm", "50", "-o", "json", *common)
    assert json.loads(out) == {
        "name": "ml",
        "limits": {"rpm": 100, "tpm": 50, "monthly_tokens": 9000000, "models": {}},
    }
    code, out, _ = _cli("keys", "team", "ml", *common)
    assert code == 0 and "rpm=100,tpm=50,monthly-tokens=9000000" in out
    code, _, err = _cli("keys", "team", "nobody", *common)
    assert code == 1 and "no team 'nobody'" in err
    code, _, err = _cli("keys", "team", "bad name", "--rpm", "1", *common)
    assert code == 2 and "use letters, digits" in err
    code, out, _ = _cli("keys", "list", "-o", "json", *common)
    assert json.loads(out) == []  # the team's record lives in the same bucket but is not a key


@pytest.mark.slow
def test_cache_scope_set_shown_and_refused_when_wrong(nats_server: NatsServer, prefix: str) -> None:
    common = ["--nats", nats_server.url, "--prefix", prefix]
    code, _, err = _cli("keys", "create", "--name", "apart", "--cache-scope", "key", *common)
    assert code == 0, err
    code, out, _ = _cli("keys", "list", "-o", "json", *common)
    assert json.loads(out)[0]["cache_scope"] == "key"
    code, out, err = _cli("keys", "update", "apart", "--cache-scope", "shared", *common)
    assert code == 0 and "cache scope shared" in out, err
    code, _, err = _cli("keys", "create", "--name", "t", "--cache-scope", "team", *common)
    assert code == 2 and "--cache-scope team needs --team" in err
    code, _, err = _cli("keys", "create", "--name", "t", "--cache-scope", "private", *common)
    assert code == 2 and "--cache-scope must be one of shared, team, key, not 'private'" in err
