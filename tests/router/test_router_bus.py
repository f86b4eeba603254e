"""The router on a real nats-server: routing and keys from KV, load reports, idle and usage reports."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Awaitable
from pathlib import Path
from typing import Any

import aiohttp
import nats
import pytest
from nats.aio.client import Client as NATS
from typer.testing import CliRunner

from llmgw_common.catalog import Catalog, ModelProfile
from llmgw_common.codec import decode, encode
from llmgw_common.messages import Endpoint, LoadReport, ReplicaLoad, RoutingCatalog, RoutingEndpoints
from llmgw_common.router_messages import IdleReport, UsageReport
from llmgw_common.subjects import Subjects
from llmgw_runtime import bus
from llmgw_runtime.apikeys import create_key, hash_key, list_keys, revoke_key
from llmgw_runtime.natsserver import NatsServer
from tests.kit.poll import eventually
from tests.router.router_helpers import EngineFactory, PortFactory, RouterFactory


async def _publish_routing(
    nc: NATS,
    prefix: str,
    endpoints: dict[str, list[Endpoint]],
    version: int = 1,
    unavailable: dict[str, str] | None = None,
    models: tuple[str, ...] = ("m1",),
) -> None:
    js = nc.jetstream()
    kv = await bus.ensure_kv(js, Subjects(prefix).bucket_routing)
    cat = Catalog(models=tuple(ModelProfile(name=m, engine="sim") for m in models))
    await kv.put("catalog", encode(RoutingCatalog(version=version, catalog=cat)))
    await kv.put(
        "endpoints",
        encode(
            RoutingEndpoints(
                version=version,
                endpoints={k: tuple(v) for k, v in endpoints.items()},
                unavailable=unavailable or {},
            )
        ),
    )


async def _status(url: str, key: str | None = None, body: dict[str, Any] | None = None) -> int:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    async with aiohttp.ClientSession() as s:
        if body is None:
            async with s.get(url, headers=headers) as resp:
                return resp.status
        async with s.post(url, json=body, headers=headers) as resp:
            await resp.read()
            return resp.status


CHAT = {"model": "m1", "messages": [{"role": "user", "content": "x"}], "max_tokens": 2}


async def test_routes_from_kv_and_revoked_key_stops_within_a_tick(
    nats_server: NatsServer, prefix: str, nc: NATS, engines: EngineFactory, routers: RouterFactory
) -> None:
    eng = await engines("m1")
    await _publish_routing(
        nc,
        prefix,
        {"m1": [Endpoint(replica_id="r1", model="m1", url=eng.url, node="n1")]},
        unavailable={"m2": "placement failing: needs 1 x A100, none free"},
        models=("m1", "m2"),
    )
    key, rec = await create_key(nc, prefix, "alice", ["m1"], None)
    assert rec.hash != key and key not in json.dumps(rec.model_dump())
    r = await routers(nats_urls=[nats_server.url], prefix=prefix, tick_s=0.2)
    await asyncio.wait_for(r.synced.wait(), 10)
    base = f"http://127.0.0.1:{r.port}/v1"
    assert await _status(f"{base}/chat/completions", key, CHAT) == 200
    async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {key}"}) as s:
        async with s.post(f"{base}/chat/completions", json={**CHAT, "model": "m2"}) as resp:
            # m2 is in the catalog but this key may only use m1: 404 as if absent.
            assert resp.status == 404
    key2, _ = await create_key(nc, prefix, "bob", None, None)
    await eventually(
        lambda: _is(_status(f"{base}/chat/completions", key2, {**CHAT, "model": "m2"}), 503),
        timeout=5.0,
        what="m2's requests to be refused with 503",
    )
    async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {key2}"}) as s:
        async with s.post(f"{base}/chat/completions", json={**CHAT, "model": "m2"}) as resp:
            err = (await resp.json())["error"]
            assert resp.status == 503 and "needs 1 x A100" in err["message"] and resp.headers["Retry-After"]
    t0 = time.monotonic()
    await revoke_key(nc, prefix, "alice")
    await eventually(
        lambda: _is(_status(f"{base}/models", key), 401),
        timeout=1.0,
        what="the revoked key to be refused with 401",
    )
    assert time.monotonic() - t0 < 1.0  # a tick
    assert await _status(f"{base}/models", key2) == 200
    with pytest.raises(Exception, match="no key"):
        await revoke_key(nc, prefix, "nobody")


async def _is(coro: Awaitable[int], value: int) -> bool:
    return await coro == value


@pytest.mark.slow
async def test_idle_usage_and_load(
    nats_server: NatsServer,
    prefix: str,
    nc: NATS,
    engines: EngineFactory,
    routers: RouterFactory,
    port: PortFactory,
) -> None:
    eng = await engines("m1")
    eps = [
        Endpoint(replica_id="used", model="m1", url=eng.url, node="n1"),
        Endpoint(replica_id="never", model="m1", url=eng.url + "/", node="n2", draining=True),
        Endpoint(replica_id="dead", model="m1", url=f"http://127.0.0.1:{port()}", node="n3"),
    ]
    await _publish_routing(nc, prefix, {"m1": eps})
    subj = Subjects(prefix)
    idles: list[IdleReport] = []
    usages: list[UsageReport] = []
    drops = bus.DropLog(logging.getLogger("t"))
    await bus.subscribe(nc, subj.all_idle(), IdleReport, lambda m, _: idles.append(m), drops)
    await bus.subscribe(nc, subj.all_usage(), UsageReport, lambda m, _: usages.append(m), drops)
    r = await routers(nats_urls=[nats_server.url], prefix=prefix, tick_s=0.1, auth=False, router_id="rA")
    await asyncio.wait_for(r.synced.wait(), 10)
    before = time.time()
    for _ in range(30):
        assert await _status(f"http://127.0.0.1:{r.port}/v1/chat/completions", None, CHAT) == 200

    def stamped() -> bool:
        return any("used" in i.last_used and i.breakers for i in idles)

    await eventually(stamped, timeout=3.0, what="an idle report with the used replica and its open breaker")
    last = idles[-1]
    assert last.router == "rA" and last.since == r.ctx.started
    assert "never" not in last.last_used  # unknown is absent, never 0 (ARCHITECTURE #1)
    assert last.last_used["used"] >= before
    # The dead replica's breaker opened; the report carries it for `ctl replicas`.
    assert last.breakers == {"dead": "open"}
    await eventually(
        lambda: bool(usages) and usages[-1].usage.get("-", {}).get("m1", [0])[0] == 30,
        timeout=3.0,
        what="a usage report with m1's 30 tokens",
    )
    assert usages[-1].since == r.ctx.started and usages[-1].router == "rA"
    # Load reports reach the pool; a garbage payload on the subject is dropped with one line.
    await nc.publish(subj.load("n1"), b"\x00garbage")
    await nc.publish(
        subj.load("n1"),
        encode(
            LoadReport(
                node="n1",
                sent_at=0.0,
                replicas=(ReplicaLoad(replica_id="used", running=3, waiting=2, kv_use=0.4),),
            )
        ),
    )
    ep = r.ctx.pool.by_replica["used"][0]
    await eventually(lambda: ep.running == 3, timeout=3.0, what="the endpoint's load to show 3 running")
    assert (ep.waiting, ep.kv_use) == (2, 0.4) and r.drops.count == 1


async def test_bad_routing_value_is_dropped_and_serving_continues_when_nats_goes_away(
    tmp_path: Path, engines: EngineFactory, routers: RouterFactory
) -> None:
    eng = await engines("m1")
    srv = NatsServer(tmp_path / "nats")
    srv.start()
    prefix = "own"
    try:
        nc = await nats.connect(srv.url)
        await _publish_routing(
            nc, prefix, {"m1": [Endpoint(replica_id="r1", model="m1", url=eng.url, node="n")]}
        )
        r = await routers(nats_urls=[srv.url], prefix=prefix, auth=False, tick_s=0.1)
        await asyncio.wait_for(r.synced.wait(), 10)
        url = f"http://127.0.0.1:{r.port}/v1/chat/completions"
        assert await _status(url, None, CHAT) == 200
        kv = await bus.ensure_kv(nc.jetstream(), Subjects(prefix).bucket_routing)
        await kv.put("endpoints", b"\xc1 not msgpack")
        await eventually(
            lambda: r.drops.count == 1, timeout=3.0, what="the router to count one dropped report"
        )
        assert await _status(url, None, CHAT) == 200  # kept what it had
        await nc.close()
    finally:
        srv.stop()
    # NATS is gone: the router keeps serving from what it holds.
    for _ in range(5):
        assert await _status(url, None, CHAT) == 200


# ---------------------------------------------------------------- llmgw keys (sync: the CLI runs its own loop)


def _cli(*args: str) -> tuple[int, str, str]:
    from llmgw_cli.main import app

    res = CliRunner().invoke(app, list(args))
    return res.exit_code, res.stdout, res.stderr


@pytest.mark.slow
def test_keys_cli_create_list_revoke(nats_server: NatsServer, prefix: str) -> None:
    common = ["--nats", nats_server.url, "--prefix", prefix]
    code, out, err = _cli("keys", "create", "--name", "ci", "--models", "m1,m2", "--expires", "30d", *common)
    assert code == 0, err
    key = out.strip()
    assert key.startswith("llmgw-") and "shown only now" in err
    code, out, _ = _cli("keys", "list", *common)
    assert code == 0 and "ci" in out and "m1,m2" in out and key not in out
    code, out, _ = _cli("keys", "list", "-o", "json", *common)
    rows = json.loads(out)
    assert rows[0]["name"] == "ci" and rows[0]["models"] == ["m1", "m2"] and "hash" not in rows[0]
    assert rows[0]["expires"] > time.time() + 29 * 86400
    code, _, err = _cli("keys", "create", "--name", "ci", *common)
    assert code == 1 and "already exists" in err
    code, out, _ = _cli("keys", "revoke", "ci", *common)
    assert code == 0 and "revoked" in out
    code, out, _ = _cli("keys", "list", "-o", "json", *common)
    assert json.loads(out)[0]["revoked"] is True
    code, _, err = _cli("keys", "revoke", "nobody", *common)
    assert code == 1 and "no key" in err
    code, _, err = _cli("keys", "create", "--name", "x", "--expires", "soon", *common)
    assert code == 2 and "--expires" in err


@pytest.mark.slow
def test_keys_cli_exits_1_when_nats_is_unreachable() -> None:
    code, _, err = _cli("keys", "list", "--nats", "nats://127.0.0.1:1")
    assert code == 1 and "cannot reach NATS at nats://127.0.0.1:1" in err


async def test_create_key_record_round_trips(nats_server: NatsServer, prefix: str, nc: NATS) -> None:
    key, rec = await create_key(nc, prefix, "n", None, time.time() + 60)
    recs = await list_keys(nc, prefix)
    assert [r.id for r in recs] == [rec.id] and recs[0].hash == hash_key(key) and recs[0].models is None
    kv = await bus.ensure_kv(nc.jetstream(), Subjects(prefix).bucket_keys)
    raw = await kv.get(rec.id)
    assert raw.value is not None
    assert decode(raw.value, type(rec)) == rec


@pytest.mark.slow
async def test_a_replica_streaming_right_now_is_reported_used_now_not_when_the_stream_began(
    nats_server: NatsServer, prefix: str, nc: NATS, engines: EngineFactory, routers: RouterFactory
) -> None:
    # A replica in the middle of a long answer is not idle: reported from its start alone, it would look
    # idle for the stream's length and could be scaled down or evicted while it serves (issue 13).
    eng = await engines("m1", ttft_ms=10, tokens_per_s=20)
    await _publish_routing(
        nc, prefix, {"m1": [Endpoint(replica_id="busy", model="m1", url=eng.url, node="n1")]}
    )
    idles: list[IdleReport] = []
    drops = bus.DropLog(logging.getLogger("t"))
    await bus.subscribe(nc, Subjects(prefix).all_idle(), IdleReport, lambda m, _: idles.append(m), drops)
    r = await routers(nats_urls=[nats_server.url], prefix=prefix, tick_s=0.1, auth=False, router_id="rA")
    await asyncio.wait_for(r.synced.wait(), 10)
    body = {**CHAT, "max_tokens": 100, "stream": True}  # 5 s at 20 tokens/s
    async with aiohttp.ClientSession() as s:
        async with s.post(f"http://127.0.0.1:{r.port}/v1/chat/completions", json=body) as resp:
            assert resp.status == 200
            started = time.time()
            await resp.content.readuntil(b"\n\n")
            # Well into the stream: a report sent now must say the replica is in use now.
            while time.time() < started + 1.5:
                await resp.content.readuntil(b"\n\n")
            mark = time.time()
            await eventually(
                lambda: any(i.sent_at >= mark + 0.2 for i in idles),
                timeout=3.0,
                what="an idle report sent after the last request",
            )
            during = next(i for i in idles if i.sent_at >= mark + 0.2)
            assert not resp.content.at_eof()  # still streaming when that report left
            assert during.last_used["busy"] >= mark
            assert during.in_flight == ["busy"]  # so the control plane never evicts it meanwhile
            await resp.read()
    # Done: no longer in flight.
    done = time.time()
    await eventually(
        lambda: any(i.sent_at >= done + 0.2 for i in idles),
        timeout=3.0,
        what="an idle report sent after the stream ended",
    )
    assert next(i for i in idles if i.sent_at >= done + 0.2).in_flight == []
