"""Two real llama.cpp models on a node that holds one (issue 13): they swap, and no request fails.

Real processes on the session's nats-server: a control plane with two catalog models served from the
one Gemma GGUF (``min_replicas: 0``), an agent whose one (simulated) card fits one replica at a time
(its engines are the real ``llama-server``, on CPU: the card is room, not compute), and a router.

- ``test_wakes_swap_two_real_models``: the control plane's side alone. Each turn asks for a wake on the
  bus as a router would, waits for the model's endpoint, and sends a real completion through the
  router: the other model's idle replica is evicted to make room, every completion succeeds.
- ``test_alternating_requests_swap_with_zero_failures``: the whole feature. Clients alternate between
  the two models through the router alone; the router holds each request for a cold model while it asks
  for the wake. Needs the router's holding (``llmgw_router.holding``); skipped where it is absent.
"""

from __future__ import annotations

import contextlib
import importlib.util
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import nats.errors
import openai
import pytest
from nats.aio.client import Client as NATS
from nats.js.errors import BucketNotFoundError

from llmgw_common.codec import decode, encode
from llmgw_common.messages import Event, RoutingEndpoints
from llmgw_common.router_messages import WakeReply, WakeRequest, WakeState
from llmgw_common.subjects import Subjects
from llmgw_runtime.natsserver import NatsServer
from llmgw_runtime.routing_rows import read_routing
from tests.e2e.e2e_cluster import shown_on_failure
from tests.kit.poll import eventually
from tests.llama.llama_kit import (
    Service,
    clean_env,
    diagnostics,
    free_port,
    start_service,
)

pytestmark = [pytest.mark.e2e, pytest.mark.xdist_group("llama"), pytest.mark.timeout(600)]

MODELS = ("gemma-a", "gemma-b")
NODE = "swap-node"
CARD = "L4-24GB"
READY_TIMEOUT_S = 240.0
ENGINE_ARGS = ["--threads", "1", "--ctx-size", "1024", "--parallel", "1"]
TURNS = 4


def catalog_yaml(weights: str) -> str:
    args = ", ".join(f'"{a}"' for a in ENGINE_ARGS)
    return "models:\n" + "".join(
        f"""  - name: {m}
    engine: llamacpp
    gpu_class: {CARD}
    replicas: 1
    min_replicas: 0
    idle_after: 10m
    weights: {weights}
    startup_timeout_s: {READY_TIMEOUT_S:.0f}
    args: [{args}]
"""
        for m in MODELS
    )


@dataclass
class Stack:
    nc: NATS
    prefix: str
    services: list[Service]
    engine_logs: Path
    router_url: str

    def diagnostics(self) -> str:
        return diagnostics(self.services, self.engine_logs)

    async def endpoints(self) -> RoutingEndpoints | None:
        with contextlib.suppress(BucketNotFoundError):
            kv = await self.nc.jetstream().key_value(Subjects(self.prefix).bucket_routing)
            ep = await read_routing(kv)
            return ep
        return None

    async def wait_serving(self, model: str) -> RoutingEndpoints:
        last: RoutingEndpoints | None = None

        async def serving() -> RoutingEndpoints | None:
            nonlocal last
            dead = [s.name for s in self.services if s.proc.poll() is not None]
            assert not dead, f"{dead} exited"
            last = await self.endpoints()
            return last if last is not None and last.endpoints.get(model) else None

        with shown_on_failure(lambda: f"({last})\n{self.diagnostics()}"):
            got = await eventually(serving, timeout=READY_TIMEOUT_S, every=0.3, what=f"{model} to be serving")
        assert got is not None  # eventually returns only a truthy value
        return got

    async def wake(self, model: str) -> WakeReply:
        req = WakeRequest(model=model, router="swap-test", sent_at=time.time())

        async def answered() -> WakeReply:
            msg = await self.nc.request(Subjects(self.prefix).wake("swap-test"), encode(req), timeout=2)
            return decode(msg.data, WakeReply)

        # No responder yet, or no answer in time: the control plane is settling; ask again.
        return await eventually(
            answered,
            timeout=30.0,
            every=0.5,
            tolerate=(nats.errors.NoRespondersError, nats.errors.TimeoutError),
            what=f"the control plane to answer a wake of {model}",
        )

    async def events(self, kind: str) -> list[Event]:
        subj = Subjects(self.prefix)
        js = self.nc.jetstream()
        try:
            info = await js.stream_info(subj.events_stream)
        except Exception:
            return []
        out = []
        for seq in range(max(1, info.state.first_seq), info.state.last_seq + 1):
            raw = await js.get_msg(subj.events_stream, seq)
            if raw.data is not None and (ev := decode(raw.data, Event)).kind == kind:
                out.append(ev)
        return out


@contextlib.asynccontextmanager
async def stack(
    llama_server: Path, gguf: Path, nats_url: str, prefix: str, nc: NATS, tmp_path: Path
) -> AsyncIterator[Stack]:
    models = tmp_path / "models"
    models.mkdir()
    (models / gguf.name).symlink_to(gguf)
    catalog = tmp_path / "catalog.yaml"
    catalog.write_text(catalog_yaml(weights=gguf.name.removesuffix(".gguf")))
    state_dir = tmp_path / "agent-state"
    router_port = free_port()
    bus_args = ["--nats", nats_url, "--prefix", prefix]
    services: list[Service] = []
    try:
        # No minimum residency: the test swaps as fast as the engines load.
        cp_env = clean_env(LLMGW_EVICTION_MIN_RESIDENCY_S="0")
        services.append(
            start_service(
                "controlplane",
                ["controlplane", *bus_args, "--catalog", str(catalog), "--admin-port", "0"],
                tmp_path,
                cp_env,
            )
        )
        agent_args = [
            "agent",
            *bus_args,
            "--node",
            NODE,
            "--model-dir",
            str(models),
            "--sim-gpus",
            f"1x{CARD}",
        ]
        agent_args += ["--real-engines", "--state-dir", str(state_dir)]
        services.append(
            start_service("agent", agent_args, tmp_path, clean_env(LLMGW_LLAMA_SERVER=str(llama_server)))
        )
        services.append(
            start_service(
                "router",
                ["router", *bus_args, "--port", str(router_port), "--admin-port", "0", "--no-auth"],
                tmp_path,
                clean_env(),
            )
        )
        yield Stack(nc, prefix, services, state_dir / "logs", f"http://127.0.0.1:{router_port}")
    finally:
        for s in reversed(services):
            s.stop()


async def complete(client: openai.AsyncOpenAI, model: str) -> str:
    resp = await client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Say hi."}], max_tokens=4, temperature=0
    )
    assert resp.model == model
    return resp.choices[0].message.content or ""


async def test_wakes_swap_two_real_models(
    llama_server: Path, gguf: Path, nats_server: NatsServer, prefix: str, nc: NATS, tmp_path: Path
) -> None:
    async with stack(llama_server, gguf, nats_server.url, prefix, nc, tmp_path) as st:
        client = openai.AsyncOpenAI(
            base_url=f"{st.router_url}/v1", api_key="unused", max_retries=0, timeout=120
        )
        failed: list[str] = []
        took: list[float] = []
        try:
            for turn in range(TURNS):
                model, other = MODELS[turn % 2], MODELS[(turn + 1) % 2]
                t0 = time.monotonic()
                reply = await st.wake(model)
                assert reply.state is WakeState.WAKING, f"{reply}\n{st.diagnostics()}"
                ep = await st.wait_serving(model)
                took.append(time.monotonic() - t0)
                # One card: the other model was evicted to make room (or was never up).
                assert other not in ep.endpoints, ep
                try:
                    await complete(client, model)
                except openai.APIError as e:
                    failed.append(f"turn {turn} {model}: {e}")
        finally:
            await client.close()
        assert failed == [], f"{failed}\n{st.diagnostics()}"
        evicted = await st.events("model.evicted")
        assert len(evicted) >= TURNS - 1, evicted
        woken = await st.events("model.woken")
        assert len(woken) >= TURNS, woken
        print(f"llama swap via wakes: wake->serving {', '.join(f'{t:.1f}s' for t in took)}")


@pytest.mark.skipif(
    importlib.util.find_spec("llmgw_router.holding") is None,
    reason="needs the router's holding of requests for cold models (llmgw_router.holding, issue 13 router side)",
)
async def test_alternating_requests_swap_with_zero_failures(
    llama_server: Path, gguf: Path, nats_server: NatsServer, prefix: str, nc: NATS, tmp_path: Path
) -> None:
    async with stack(llama_server, gguf, nats_server.url, prefix, nc, tmp_path) as st:
        # Wait for the control plane to publish (both models cold) before the first request.
        async def both_cold() -> bool:
            ep = await st.endpoints()
            return ep is not None and set(ep.cold) == set(MODELS)

        with shown_on_failure(st.diagnostics):
            await eventually(
                both_cold, timeout=60.0, every=0.3, what="the control plane to publish both models cold"
            )
        client = openai.AsyncOpenAI(
            base_url=f"{st.router_url}/v1", api_key="unused", max_retries=0, timeout=READY_TIMEOUT_S
        )
        failed: list[str] = []
        try:
            for turn in range(TURNS):
                model = MODELS[turn % 2]
                try:
                    await complete(client, model)
                except openai.APIError as e:
                    failed.append(f"turn {turn} {model}: {e}")
        finally:
            await client.close()
        assert failed == [], f"{failed}\n{st.diagnostics()}"
        assert len(await st.events("model.evicted")) >= TURNS - 1
