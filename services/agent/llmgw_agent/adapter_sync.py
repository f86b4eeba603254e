"""LoRA adapters on this node's engines: each ready replica's loaded adapters made what its assignment
asks, through the engine's runtime API, and reported (issue 33).

Once a tick, for shard 0 of every ready replica that serves adapters (``LaunchSpec.lora_url``) or is
asked for some: read what the engine holds (``GET /v1/models``: a card with a ``parent`` is an
adapter, its ``root`` the path it came from), plan (:func:`llmgw_agent.adapter_plan.plan_adapters`),
then unload (``POST /v1/unload_lora_adapter``) and load (``POST /v1/load_lora_adapter``, side by side,
each its own task). A change of the assignment starts a pass at once, not at the next tick. Each
replica has at most one pass under way, off the tick; asked again meanwhile, it makes another. A pass
does not wait for its loads (a load may take seconds): an adapter asked for while others load starts
loading at once; the engine's list is read by a pass with no load under way. When
a load or unload ends (or a refusal or the engine's own list changes what is reported), ``changed`` is
told the replica at once: its load line goes out then, not at the next reading, as requests held for the
adapter wait for it (:meth:`llmgw_agent.load_feed.LoadFeed.read_now`). The engine's own list is the
truth, so an engine that restarted (it lists none) gets its adapters again, and one re-adopted after
an agent restart is read, not assumed. Never a restart: adapters are not in the assignment's
fingerprint (:mod:`llmgw_agent.converge`).

An adapter's weights are found as a model's are (``AdapterLoad.weights``: a path, or a name under the
model directories); on a real engine an adapter whose weights are not here, or not whole, is not sent
to the engine. Failures are reported per adapter in the user's terms (:func:`describe_failure`).
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import time
from collections.abc import Callable, Coroutine, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from llmgw_agent.adapter_plan import Failure, WantedAdapter, plan_adapters
from llmgw_agent.converge import ShardKey
from llmgw_agent.engines import find_weights
from llmgw_agent.settings import AgentSettings
from llmgw_agent.storage import weights_problem
from llmgw_agent.supervisor import Shard
from llmgw_common.messages import AdapterLoad, ShardAssignment

log = logging.getLogger("llmgw.agent.adapters")

# A failed load is tried again after this long (or at once when its weights' path changes).
RETRY_S = 30.0
# A load reads the adapter's weights: on a busy node that is seconds, not milliseconds.
LOAD_TIMEOUT_S = 120.0
LOAD_PATH = "/v1/load_lora_adapter"
UNLOAD_PATH = "/v1/unload_lora_adapter"
LLAMACPP_NO_RUNTIME = (
    "llama.cpp loads LoRA adapters only when its server starts (--lora): it cannot load one at run time"
)

_RANK_RE = re.compile(r"LoRA rank (\d+) is greater than max_lora_rank (\d+)")


@dataclass(eq=False)
class _Replica:
    """What this agent knows of one engine's adapters; started anew with each engine process."""

    pid: int | None
    # Adapter name -> the path the engine loaded it from, as last read or made.
    loaded: dict[str, str] = field(default_factory=dict)
    failures: dict[str, Failure] = field(default_factory=dict)
    task: asyncio.Task[None] | None = None
    # Asked for again while a pass was under way (the assignment changed): another pass follows at once.
    again: bool = False
    # Loads under way, by adapter: a pass starts them and ends, so that an adapter asked for meanwhile
    # starts loading at once rather than after them.
    loading: dict[str, asyncio.Task[None]] = field(default_factory=dict)

    def stop(self) -> None:
        for t in [self.task, *self.loading.values()]:
            if t is not None:
                t.cancel()


def describe_failure(status: int, body: str, path: str) -> str:
    """Why the engine refused to load an adapter, in the user's terms."""
    message = body.strip()
    detail = None
    try:
        parsed: Any = json.loads(body)
    except ValueError:
        parsed = None
    if isinstance(parsed, dict):
        err = parsed.get("error")
        if isinstance(err, dict) and isinstance(err.get("message"), str):
            message = err["message"]
        elif isinstance(parsed.get("detail"), str):
            detail = parsed["detail"]
    message = message[:300]
    if status in (404, 405) and detail is not None:
        return (
            "the engine serves no runtime LoRA API (vLLM needs --enable-lora and "
            "VLLM_ALLOW_RUNTIME_LORA_UPDATING=True)"
        )
    if "No adapter found" in message:
        return (
            f"missing weights: no LoRA adapter at {path} (adapter_config.json and adapter_model.safetensors)"
        )
    rank = _RANK_RE.search(message)
    if rank is not None:
        return f"rank too large: the adapter's rank is {rank[1]}, the base allows at most {rank[2]} (max_lora_rank)"
    if "size of tensor" in message or "must match" in message or "shape" in message:
        return f"wrong base: its weights do not fit the base model ({message})"
    return f"the engine refused to load it (HTTP {status}): {message}"


class AdapterSync:
    """Converges and reports the adapters of this node's engines; :meth:`sync` once a tick."""

    def __init__(
        self,
        s: AgentSettings,
        wanted: Callable[[ShardKey], ShardAssignment | None],
        *,
        retry_s: float = RETRY_S,
        clock: Callable[[], float] = time.time,
        changed: Callable[[ShardKey], None] = lambda key: None,
    ) -> None:
        self.s = s
        # Told a replica whose report (adapters loaded, load errors) a pass just changed.
        self.changed = changed
        # The current assignment of a shard (the supervisor's copy predates an adapters-only change).
        self._assignment = wanted
        self.retry_s = retry_s
        self.clock = clock
        self._http = httpx.AsyncClient(timeout=httpx.Timeout(LOAD_TIMEOUT_S, connect=1.0))
        self._replicas: dict[ShardKey, _Replica] = {}
        self._tasks: set[asyncio.Task[None]] = set()

    # ---------------------------------------------------------------- the tick's side

    def sync(self, ready: Iterable[Shard]) -> None:
        """Start a pass for each ready replica that serves or is asked for adapters (one under way is
        followed by another at once); forget replicas that are no longer ready. Called every tick and
        when the assignment changes, so that an adapter asked for starts loading without waiting."""
        live: set[ShardKey] = set()
        for sh in ready:
            a = self._assignment(sh.key) or sh.assignment
            if sh.spec is None or a.shard != 0 or (sh.spec.lora_url is None and not a.adapters):
                continue
            live.add(sh.key)
            r = self._replicas.get(sh.key)
            if r is None or r.pid != sh.pid:
                if r is not None:
                    r.stop()
                r = self._replicas[sh.key] = _Replica(pid=sh.pid)
            if r.task is None or r.task.done():
                r.task = self._spawn(self._passes(sh, r), f"adapters-{a.replica_id}")
            else:
                r.again = True
        for key in set(self._replicas) - live:
            self._replicas.pop(key).stop()

    def report(self, key: ShardKey) -> tuple[tuple[str, ...], dict[str, str]]:
        """(adapters loaded, adapter -> why its last load failed) of one replica's engine."""
        r = self._replicas.get(key)
        if r is None:
            return (), {}
        return tuple(r.loaded), {name: f.error for name, f in r.failures.items()}

    async def passes_done(self) -> None:
        """Return once the passes under way have ended (their results are in :meth:`report`)."""
        while self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)

    async def aclose(self) -> None:
        tasks = list(self._tasks)
        for t in tasks:
            t.cancel()
        # A pass that crashed was logged when it ended (_done): its exception is not raised again here.
        await asyncio.gather(*tasks, return_exceptions=True)
        await self._http.aclose()

    def _spawn(self, work: Coroutine[Any, Any, None], name: str) -> asyncio.Task[None]:
        task: asyncio.Task[None] = asyncio.create_task(work, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._done)
        return task

    def _done(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and (e := task.exception()) is not None:
            # A bug, not an engine's answer: said loudly; the next tick starts a new pass.
            log.error("adapter pass %s crashed", task.get_name(), exc_info=e)

    # ---------------------------------------------------------------- one pass

    async def _passes(self, sh: Shard, r: _Replica) -> None:
        """Passes over one replica until none was asked for meanwhile, each with the assignment of now."""
        while True:
            r.again = False
            await self._pass(sh, self._assignment(sh.key) or sh.assignment, r)
            if not r.again:
                return

    def _tell(self, key: ShardKey, before: tuple[tuple[str, ...], dict[str, str]]) -> None:
        (loaded, errors), (was, were) = self.report(key), before
        if set(loaded) != set(was) or errors != were:
            self.changed(key)

    async def _told(self, key: ShardKey, work: Coroutine[Any, Any, None]) -> None:
        """``work`` (a load or an unload), then its change told at once: loads side by side do not
        wait for each other's to be reported."""
        before = self.report(key)
        try:
            await work
        finally:
            self._tell(key, before)

    async def _pass(self, sh: Shard, a: ShardAssignment, r: _Replica) -> None:
        assert sh.spec is not None
        url = sh.spec.lora_url
        key = sh.key
        before = self.report(key)
        now = self.clock()
        names = {ad.name for ad in a.adapters}
        for stale in set(r.failures) - names:
            del r.failures[stale]
        if url is None:
            why = (
                LLAMACPP_NO_RUNTIME
                if a.engine == "llamacpp"
                else f"the base profile of {a.model} serves no adapters (it has no max_loras)"
            )
            r.failures = {ad.name: Failure(None, why, now) for ad in a.adapters}
            self._tell(key, before)
            return
        if not r.loading:
            # With loads under way the engine's list lacks them yet (a read racing one would drop it
            # from what is reported): what the loads made is kept, and a later pass reads.
            try:
                r.loaded = await self._read(url)
            except (httpx.HTTPError, ValueError) as e:
                log.debug("cannot read the adapters of %s at %s: %s", a.replica_id, url, e)
                return
        wanted = [self._resolve(ad, a, sh.spec.simulated) for ad in a.adapters]
        plan = plan_adapters(wanted, r.loaded, r.failures, now, self.retry_s)
        for name, why in plan.refused.items():
            r.failures[name] = Failure(None, why, now)
        # What the engine lists (a restart dropped its adapters) and the refusals, told before the loads.
        self._tell(key, before)
        # Unloads first (they free the slots the loads take), then the loads side by side, each its own
        # task: a request held for one adapter waits neither for another's load nor for this pass.
        unload = [name for name in plan.unload if name not in r.loading]
        await asyncio.gather(*(self._told(key, self._unload(url, name, r)) for name in unload))
        for name, path in plan.load:
            if name not in r.loading:
                work = self._loading(key, url, name, path, r, sh.spec.simulated)
                r.loading[name] = self._spawn(work, f"adapter-load-{a.replica_id}-{name}")

    async def _loading(
        self, key: ShardKey, url: str, name: str, path: str, r: _Replica, simulated: bool
    ) -> None:
        try:
            await self._told(key, self._checked_load(url, name, path, r, simulated))
        finally:
            r.loading.pop(name, None)

    async def _checked_load(self, url: str, name: str, path: str, r: _Replica, simulated: bool) -> None:
        """Load one adapter, on a real engine only once its weights are whole on disk."""
        problem = None if simulated else await asyncio.to_thread(weights_problem, Path(path))
        if problem is not None:
            why = f"missing weights: {path} is not a whole adapter ({problem})"
            r.failures[name] = Failure(path, why, self.clock())
            return
        await self._load(url, name, path, r)

    def _resolve(self, ad: AdapterLoad, a: ShardAssignment, simulated: bool) -> WantedAdapter:
        """Where this node's engine loads ``ad`` from, or why it cannot."""
        if ad.rank is not None and a.max_lora_rank is not None and ad.rank > a.max_lora_rank:
            return WantedAdapter(
                ad.name,
                None,
                f"rank too large: the adapter's rank is {ad.rank}, the base allows at most "
                f"{a.max_lora_rank} (max_lora_rank)",
            )
        given = Path(ad.weights)
        found = (
            (given if given.exists() else None) if given.is_absolute() else find_weights(self.s, ad.weights)
        )
        if found is not None:
            return WantedAdapter(ad.name, str(found))
        if simulated:
            # A simulated engine's weights need not exist (the simulator reads files only when asked to).
            return WantedAdapter(ad.name, ad.weights)
        dirs = ", ".join(self.s.model_dirs) or "no model directories configured"
        return WantedAdapter(
            ad.name, None, f"missing weights: {ad.weights} is not on node {self.s.node} (looked in: {dirs})"
        )

    async def _read(self, url: str) -> dict[str, str]:
        r = await self._http.get(url + "/v1/models", timeout=5.0)
        r.raise_for_status()
        cards = r.json()["data"]
        return {
            str(c["id"]): str(c.get("root") or "")
            for c in cards
            if isinstance(c, dict) and c.get("parent") and "id" in c
        }

    async def _load(self, url: str, name: str, path: str, r: _Replica) -> None:
        body = {"lora_name": name, "lora_path": path}
        try:
            resp = await self._http.post(url + LOAD_PATH, json=body)
        except httpx.HTTPError as e:
            r.failures[name] = Failure(
                path, f"the engine did not answer the load ({type(e).__name__}: {e})", self.clock()
            )
            return
        if resp.status_code == 200:
            r.loaded[name] = path
            r.failures.pop(name, None)
            log.info("adapter %s loaded from %s on %s", name, path, url)
            return
        if resp.status_code == 400 and "already been loaded" in resp.text:
            return  # loaded meanwhile (a pass of a previous agent run): read at the next pass
        why = describe_failure(resp.status_code, resp.text, path)
        r.failures[name] = Failure(path, why, self.clock())
        log.warning("adapter %s did not load on %s: %s", name, url, why)

    async def _unload(self, url: str, name: str, r: _Replica) -> None:
        try:
            resp = await self._http.post(url + UNLOAD_PATH, json={"lora_name": name}, timeout=10.0)
        except httpx.HTTPError as e:
            log.warning("cannot unload adapter %s on %s: %s", name, url, e)
            return
        if resp.status_code in (200, 404):  # 404: gone already
            r.loaded.pop(name, None)
            log.info("adapter %s unloaded on %s", name, url)
        else:
            log.warning(
                "unload of adapter %s on %s refused (HTTP %d): %s", name, url, resp.status_code, resp.text
            )
