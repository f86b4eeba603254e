"""How far the usage ledger is behind, as Prometheus reads it (ledgermetrics.py): the age of the oldest
usage not yet written and whether writes fail, on a fake clock over a real nats-server's bucket (the
writer's own sleeps are real; the ages are the fake clock's)."""

from __future__ import annotations

import asyncio

import pytest
from nats.aio.client import Client as NATS
from prometheus_client import CollectorRegistry, generate_latest

from llmgw_common.subjects import Subjects
from llmgw_router.tenancy.ledger import Ledger
from llmgw_router.tenancy.ledgermetrics import LedgerMetrics
from llmgw_router.tenancy.usage import UsageTable
from llmgw_runtime import bus
from llmgw_runtime.usage_ledger import read_hours
from tests.kit.poll import eventually
from tests.kit.promtext import family_names, value
from tests.router.tenancy.test_router_usage_ledger_faults import NOW, Gated, Unavailable, _ledger, _totals

AGE = "llmgw_router_usage_ledger_oldest_unwritten_seconds"
FAILING = "llmgw_router_usage_ledger_failing"
WRITES = "llmgw_router_usage_ledger_writes_total"


def scrape(ledger: Ledger | None) -> str:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(LedgerMetrics(lambda: ledger))
    return generate_latest(registry).decode()


def test_a_router_without_a_ledger_exports_none_of_it() -> None:
    assert not {AGE, FAILING, WRITES} & family_names(scrape(None))


@pytest.mark.slow
async def test_the_age_grows_while_the_bus_is_away_and_is_0_once_written(prefix: str, nc: NATS) -> None:
    kv = await bus.ensure_kv(nc.jetstream(), Subjects(prefix).bucket_usage)
    now, up = [NOW], [False]
    table = UsageTable(since=100.0, clock=lambda: now[0])
    ledger = Ledger(table, kv, "w0", lambda: up[0], lambda: now[0], interval_s=0.05)
    text = scrape(ledger)
    assert (value(text, AGE), value(text, FAILING), value(text, WRITES, outcome="ok")) == (0, 0, 0)
    writer = asyncio.create_task(ledger.run())
    try:
        table.add("k1", "m1", (1, 1))
        await eventually(lambda: ledger.failing, timeout=5, what="the writer to find the bus away")
        now[0] += 30
        table.add("k1", "m1", (1, 1))  # a newer one does not make the oldest younger
        now[0] += 15
        text = scrape(ledger)
        assert value(text, AGE) == 45 and value(text, FAILING) == 1
        # Not a failed write: none was tried.
        assert value(text, WRITES, outcome="failed") == 0 and value(text, WRITES, outcome="ok") == 0
        up[0] = True
        await eventually(lambda: ledger.written == table.version, timeout=5, what="the write once back")
        text = scrape(ledger)
        assert (value(text, AGE), value(text, FAILING), value(text, WRITES, outcome="ok")) == (0, 0, 1)
    finally:
        writer.cancel()
        with pytest.raises(asyncio.CancelledError):
            await writer


@pytest.mark.slow
async def test_writes_refused_with_the_bus_up_are_failing_and_counted(prefix: str, nc: NATS) -> None:
    kv = await bus.ensure_kv(nc.jetstream(), Subjects(prefix).bucket_usage)
    down = Unavailable(kv)
    now = [NOW]
    table, ledger = _ledger(down, now)
    writer = asyncio.create_task(ledger.run())
    try:
        table.add("k1", "m1", (5, 7))
        await eventually(lambda: ledger.failed >= 2, timeout=5, what="two failed writes (one retry)")
        now[0] += 200
        text = scrape(ledger)
        assert value(text, AGE) == 200 and value(text, FAILING) == 1
        failed = value(text, WRITES, outcome="failed")
        assert failed is not None and failed >= 2
        down.down = False
        await eventually(lambda: not ledger.failing, timeout=5, what="the writes to succeed again")
        text = scrape(ledger)
        assert value(text, AGE) == 0 and value(text, FAILING) == 0
    finally:
        writer.cancel()
        with pytest.raises(asyncio.CancelledError):
            await writer


async def test_usage_added_during_a_write_is_dated_from_that_write(prefix: str, nc: NATS) -> None:
    """Not from the next wake (the writer paces itself): the age may read a write's time high, never low."""
    kv = await bus.ensure_kv(nc.jetstream(), Subjects(prefix).bucket_usage)
    gated = Gated(kv)
    now = [NOW]
    table, ledger = _ledger(gated, now)
    table.add("k1", "m1", (5, 7))
    flush = asyncio.create_task(ledger.flush())
    await asyncio.wait_for(gated.entered.wait(), 5)
    now[0] += 4
    table.add("k1", "m1", (1, 1))  # after the write took the table's counts
    gated.go.set()
    assert await flush is True
    now[0] += 1
    assert ledger.oldest_unwritten_s() == 5  # the write began 5 s ago; the usage is 1 s old
    assert await ledger.flush() is True
    assert ledger.oldest_unwritten_s() == 0


async def test_a_lost_bucket_is_failing_until_it_is_made_again(prefix: str, nc: NATS) -> None:
    """A real JetStream refusal, the bus up: the bucket's stream deleted (an operator's mistake, a lost
    stream) answers no write; made again, the usage held in memory is written whole."""
    js = nc.jetstream()
    bucket = Subjects(prefix).bucket_usage
    kv = await bus.ensure_kv(js, bucket)
    now = [NOW]
    table, ledger = _ledger(kv, now)
    table.add("k1", "m1", (5, 7))
    assert await ledger.flush() is True
    await js.delete_key_value(bucket)
    table.add("k1", "m1", (1, 1))
    assert await ledger.flush() is False
    now[0] += 10
    text = scrape(ledger)
    assert value(text, AGE) == 10 and value(text, FAILING) == 1
    assert value(text, WRITES, outcome="failed") == 1
    await bus.ensure_kv(js, bucket)
    assert await ledger.flush() is True
    text = scrape(ledger)
    assert value(text, AGE) == 0 and value(text, FAILING) == 0
    assert _totals(await read_hours(kv)) == [("1970-01-01T10", 2, 14)]
