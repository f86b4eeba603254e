"""A notifier SIGKILLed mid-delivery and restarted loses nothing and repeats only what was unconfirmed."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from llmgw_common.messages import Webhook
from llmgw_notifier.delivery import consumer_name
from llmgw_notifier.targets import target_id
from llmgw_runtime.natsserver import NatsServer
from tests.kit.poll import eventually
from tests.notifier.notifier_helpers import Bus, ev

pytestmark = pytest.mark.e2e


def start_notifier(nats_server: NatsServer, prefix: str, log: Path) -> subprocess.Popen[bytes]:
    env = {
        **os.environ,
        "LLMGW_ACK_WAIT_S": "4",
        "LLMGW_GROUP_WINDOW_S": "0",
        "LLMGW_RETRY_BASE_S": "0.05",
        "LLMGW_RETRY_MAX_S": "0.2",
        "LLMGW_HTTP_TIMEOUT_S": "30",
    }
    env.pop("LLMGW_CONFIG", None)
    cmd = [sys.executable, "-m", "llmgw_cli", "notifier", "--nats", nats_server.url, "--prefix", prefix]
    with log.open("ab") as out:
        return subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)


async def test_sigkill_mid_delivery_loses_nothing_and_repeats_only_the_unconfirmed(
    nats_server: NatsServer, prefix: str, bus: Bus, receivers: Any, tmp_path: Path
) -> None:
    fast, stuck = await receivers(), await receivers()
    await bus.set_webhooks(Webhook(url=fast.url), Webhook(url=stuck.url, format="json", secret="k"))
    events = [ev("node.lost", f"n{i}", i) for i in range(10)]
    stuck.hang_on = {events[3].id}  # the stuck receiver holds the 4th event until the notifier dies
    log = tmp_path / "notifier.log"
    proc = start_notifier(nats_server, prefix, log)
    try:
        for e in events:
            await bus.publish(e)
        await eventually(
            lambda: events[3].id in stuck.ids,
            timeout=20,
            what="the stuck receiver to hold the 4th event in flight",
        )
        await eventually(
            lambda: len(fast.taken()) == 10, timeout=10, what="the fast receiver to take all ten events"
        )
        # Taken is not yet confirmed: wait for the fast target's acks to reach the server.
        settled = await bus.settled(consumer_name(prefix, target_id(fast.url)))
        assert settled.num_ack_pending == 0
        os.kill(proc.pid, signal.SIGKILL)
        await asyncio.to_thread(proc.wait, 10)
        stuck.hang_on = set()  # its next try is answered
        assert stuck.ids == [e.id for e in events[:4]]

        proc = start_notifier(nats_server, prefix, log)
        await eventually(
            lambda: log.read_text().count("notifier up") == 2,
            timeout=20,
            what="the notifier to log that it is up a second time",
        )
        late = ev("node.lost", "n-late", 10)
        # Published before the dead notifier's unconfirmed events come back (after ack_wait_s): it must
        # not overtake them.
        await bus.publish(late)
        await eventually(
            lambda: late.id in stuck.ids, timeout=20, what="the stuck receiver to get the late event"
        )
        await eventually(
            lambda: late.id in fast.ids, timeout=10, what="the fast receiver to get the late event"
        )
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                await asyncio.to_thread(proc.wait, 10)
            except subprocess.TimeoutExpired:
                proc.kill()
                await asyncio.to_thread(proc.wait)
    ids = [e.id for e in events]
    # The stuck receiver: the first three once, the 4th again (never confirmed), then the rest in order.
    assert stuck.ids == ids[:4] + ids[3:] + [late.id], log.read_text()[-3000:]
    # The fast receiver had confirmed everything: nothing repeated.
    assert fast.ids == [*ids, late.id], log.read_text()[-3000:]
    # No webhook URL in the log: a Slack URL is a credential.
    assert fast.url not in log.read_text() and stuck.url not in log.read_text()
    assert proc.returncode == 0
