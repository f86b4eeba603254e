"""`llmgw keys usage` against a real nats-server holding ledger hours of several router incarnations:
sums per model, day and hour, one key by id or name, json and csv, and clear errors for a bad --since,
an unknown key or a format it does not write."""

from __future__ import annotations

import asyncio
import csv
import io
import json
import time

import nats
import pytest
from typer.testing import CliRunner

from llmgw_common.codec import encode
from llmgw_common.messages import UsageHour
from llmgw_common.subjects import Subjects
from llmgw_runtime import bus
from llmgw_runtime.apikeys import create_key
from llmgw_runtime.natsserver import NatsServer
from llmgw_runtime.usage_ledger import HOUR, hour_start, ledger_key


def _cli(*args: str) -> tuple[int, str, str]:
    from llmgw_cli.main import app

    res = CliRunner().invoke(app, list(args))
    return res.exit_code, res.stdout, res.stderr


def _seed(url: str, prefix: str) -> tuple[str, str, float]:
    """Keys a (two models, two routers, a restart, this hour and 30 hours ago) and b; an hour of a
    from 10 days ago, outside --since 7d. Returns the key ids and this hour's start."""

    async def go() -> tuple[str, str, float]:
        nc = await nats.connect(url)
        try:
            _, a = await create_key(nc, prefix, "team-a")
            _, b = await create_key(nc, prefix, "team-b")
            kv = await bus.ensure_kv(nc.jetstream(), Subjects(prefix).bucket_usage)
            now = hour_start(time.time())
            hours = [
                UsageHour(router="r0", since=1.0, hour=now, written_at=now, usage={a.id: {"m1": (2, 20, 5)}}),
                # r0 restarted: a new incarnation, its own key, added to the first.
                UsageHour(
                    router="r0",
                    since=2.0,
                    hour=now,
                    written_at=now,
                    usage={a.id: {"m1": (1, 10, 3), "m2": (1, 7, 1)}, b.id: {"m1": (4, 40, 8)}},
                ),
                UsageHour(router="r1", since=1.0, hour=now - 30 * HOUR, written_at=now, usage={a.id: {"m1": (3, 30, 9)}}),
                UsageHour(router="r1", since=1.0, hour=now - 240 * HOUR, written_at=now, usage={a.id: {"m1": (100, 1, 1)}}),
            ]  # fmt: skip
            for h in hours:
                await kv.put(ledger_key(h.hour, h.router, h.since), encode(h))
            return a.id, b.id, now
        finally:
            await nc.close()

    return asyncio.run(go())


@pytest.mark.slow
def test_usage_sums_every_incarnation_by_model_day_and_hour(nats_server: NatsServer, prefix: str) -> None:
    a, b, now = _seed(nats_server.url, prefix)
    common = ["--nats", nats_server.url, "--prefix", prefix]
    code, out, err = _cli("keys", "usage", "-o", "json", *common)
    assert code == 0, err
    got = {
        (r["key"], r["model"]): (r["requests"], r["prompt_tokens"], r["completion_tokens"])
        for r in json.loads(out)
    }
    assert got == {("team-a", "m1"): (6, 60, 17), ("team-a", "m2"): (1, 7, 1), ("team-b", "m1"): (4, 40, 8)}
    # One key, by name, per day: today's two incarnations and the hour 30 h ago on its own day.
    code, out, err = _cli("keys", "usage", "team-a", "--by", "day", "-o", "csv", *common)
    assert code == 0, err
    rows = list(csv.DictReader(io.StringIO(out)))
    today = time.strftime("%Y-%m-%d", time.gmtime(now))
    before = time.strftime("%Y-%m-%d", time.gmtime(now - 30 * HOUR))
    assert {r["day"]: int(r["total_tokens"]) for r in rows} == {today: 46, before: 39}
    assert {r["key_id"] for r in rows} == {a}
    # --since 30d reaches the hour 10 days back; --since 1h only this hour. By id, as a table.
    code, out, _ = _cli("keys", "usage", a, "--since", "30d", "-o", "json", *common)
    assert sum(r["requests"] for r in json.loads(out)) == 107
    code, out, _ = _cli("keys", "usage", b, "--since", "1h", "--by", "hour", *common)
    header, line = out.splitlines()
    assert header.split()[:3] == ["KEY_ID", "KEY", "HOUR"] and line.split()[1:] == [
        "team-b", time.strftime("%Y-%m-%dT%H", time.gmtime(now)), "4", "40", "8", "48"
    ]  # fmt: skip


def test_bad_since_unknown_key_and_format_exit_nonzero_saying_what(
    nats_server: NatsServer, prefix: str
) -> None:
    common = ["--nats", nats_server.url, "--prefix", prefix]
    code, _, err = _cli("keys", "usage", "--since", "7 days", *common)
    assert code == 2 and "--since '7 days' is not a duration (use e.g. 24h, 7d, 30d)" in err
    code, _, err = _cli("keys", "usage", "--since", "0s", *common)
    assert code == 2 and "--since must be longer than 0" in err
    code, _, err = _cli("keys", "usage", "-o", "yaml", *common)
    assert code == 2 and "-o 'yaml': use one of table, json, csv" in err
    code, _, err = _cli("keys", "usage", "nobody", *common)
    assert code == 1 and "no key with id or name 'nobody'" in err
    code, out, err = _cli("keys", "usage", *common)
    assert code == 0 and out == "no usage in that time\n", err
