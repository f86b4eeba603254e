"""The agent's LoRA adapters (issue 33), in parts: the converge plan on a fake clock, vLLM's refusals put
in the user's terms, vllm:lora_requests_info read as vLLM writes it, the engines' LoRA flags, and the
storage scan that knows an adapter's directory."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import struct
from pathlib import Path

import pytest

from llmgw_agent.adapter_plan import Failure, WantedAdapter, plan_adapters
from llmgw_agent.adapter_sync import AdapterSync, describe_failure
from llmgw_agent.engines import LaunchSpec, Refusal, launch_spec
from llmgw_agent.metrics import lora_busy
from llmgw_agent.settings import AgentSettings
from llmgw_agent.storage import scan_model_dirs
from llmgw_agent.supervisor import Shard
from llmgw_common.messages import AdapterLoad, ShardAssignment, ShardState
from llmgw_sim.options import SimOptions
from llmgw_sim.serving import start

# ---------------------------------------------------------------- the plan


def wanted(*names: str) -> list[WantedAdapter]:
    return [WantedAdapter(n, f"/w/{n}") for n in names]


def test_plan_loads_what_is_missing_and_unloads_what_is_not_asked() -> None:
    plan = plan_adapters(wanted("a", "b"), {"b": "/w/b", "x": "/w/x"}, {}, now=0.0, retry_s=30)
    assert plan.load == [("a", "/w/a")]
    assert plan.unload == ["x"]
    assert not plan.refused


def test_plan_after_an_engine_restart_loads_everything_again() -> None:
    plan = plan_adapters(wanted("a", "b"), {}, {}, now=0.0, retry_s=30)
    assert plan.load == [("a", "/w/a"), ("b", "/w/b")] and plan.unload == []


def test_plan_reloads_an_adapter_whose_weights_moved() -> None:
    plan = plan_adapters(wanted("a"), {"a": "/old/a"}, {}, now=0.0, retry_s=30)
    assert plan.unload == ["a"] and plan.load == [("a", "/w/a")]


def test_plan_is_empty_when_the_engine_holds_what_is_asked() -> None:
    assert plan_adapters(wanted("a"), {"a": "/w/a"}, {}, now=0.0, retry_s=30).empty


def test_a_failed_load_waits_retry_s_unless_its_path_changed() -> None:
    failed = {"a": Failure("/w/a", "missing weights", at=100.0)}
    assert plan_adapters(wanted("a"), {}, failed, now=129.0, retry_s=30).load == []
    assert plan_adapters(wanted("a"), {}, failed, now=130.0, retry_s=30).load == [("a", "/w/a")]
    moved = {"a": Failure("/elsewhere/a", "missing weights", at=100.0)}
    assert plan_adapters(wanted("a"), {}, moved, now=101.0, retry_s=30).load == [("a", "/w/a")]


def test_an_adapter_that_cannot_be_loaded_here_is_refused_without_the_engine() -> None:
    plan = plan_adapters([WantedAdapter("a", None, "missing weights: a")], {"a": "/w/a"}, {}, 0.0, 30)
    assert plan.refused == {"a": "missing weights: a"}
    assert plan.load == [] and plan.unload == []  # a loaded copy is left as it is


# ---------------------------------------------------------------- vLLM's answers


def vllm_error(status: int, message: str, type_: str) -> str:
    return json.dumps({"error": {"message": message, "type": type_, "param": None, "code": status}})


@pytest.mark.parametrize(
    ("status", "body", "want"),
    [
        # The messages vLLM 0.32 on CPU answered (see /work notes of issue 33).
        (
            404,
            vllm_error(404, "Loading lora fr failed: No adapter found for <path>", "NotFoundError"),
            "missing weights: no LoRA adapter at /w/fr",
        ),
        (
            500,
            vllm_error(
                500,
                "Call to add_lora method failed: LoRA rank 16 is greater than max_lora_rank 8.",
                "InternalServerError",
            ),
            "rank too large: the adapter's rank is 16, the base allows at most 8",
        ),
        (
            500,
            vllm_error(
                500,
                "Call to add_lora method failed: The size of tensor a (640) must match the size of tensor b "
                "(999) at non-singleton dimension 1",
                "InternalServerError",
            ),
            "wrong base: its weights do not fit the base model",
        ),
        (404, json.dumps({"detail": "Not Found"}), "the engine serves no runtime LoRA API"),
        (503, "overloaded", "the engine refused to load it (HTTP 503): overloaded"),
    ],
)
def test_refusals_are_said_in_the_users_terms(status: int, body: str, want: str) -> None:
    assert describe_failure(status, body, "/w/fr").startswith(want)


# What vLLM 0.32 served with max_loras 2 after requests for three adapters (values: the time each
# label set was last set; the current one is the largest).
VLLM_PAGE = """\
# HELP vllm:lora_requests_info Running stats on lora requests.
# TYPE vllm:lora_requests_info gauge
vllm:lora_requests_info{max_lora="2",running_lora_adapters="",waiting_lora_adapters=""} 1.7963234030067117e+09
vllm:lora_requests_info{max_lora="2",running_lora_adapters="lora-a",waiting_lora_adapters="lora-a"} 1.7963234029685328e+09
vllm:lora_requests_info{max_lora="2",running_lora_adapters="lora-b,lora-c",waiting_lora_adapters="lora-b,lora-c"} 1.7963234235405824e+09
vllm:lora_requests_info{max_lora="2",running_lora_adapters="lora-b",waiting_lora_adapters="lora-b"} 1.7963234221805208e+09
vllm:num_requests_running{engine="0",model_name="gemma"} 2.0
"""


def test_busy_adapters_come_from_the_newest_series() -> None:
    assert lora_busy(VLLM_PAGE) == ("lora-b", "lora-c")
    idle = (
        VLLM_PAGE
        + 'vllm:lora_requests_info{max_lora="2",running_lora_adapters="",waiting_lora_adapters=""} 1.8e9\n'
    )
    assert lora_busy(idle) == ()
    waiting_only = (
        'vllm:lora_requests_info{max_lora="1",running_lora_adapters="a",waiting_lora_adapters="b"} 5\n'
    )
    assert lora_busy(waiting_only) == ("a", "b")
    assert lora_busy("vllm:num_requests_running 1\n") is None
    assert lora_busy('vllm:lora_requests_info{max_lora="1",running_lora_adapters="a"} nan-ish\n') is None


# ---------------------------------------------------------------- the engines' flags


def settings(tmp_path: Path, **kw: object) -> AgentSettings:
    return AgentSettings(node="n1", state_dir=str(tmp_path / "state"), **kw)  # type: ignore[arg-type]


def shard(engine: str, **kw: object) -> ShardAssignment:
    base: dict[str, object] = dict(replica_id="r1", shard=0, model="gemma", engine=engine, port=18000)
    base.update(kw)
    return ShardAssignment(**base)  # type: ignore[arg-type]


def spec_of(a: ShardAssignment, s: AgentSettings) -> LaunchSpec:
    out = launch_spec(a, s)
    assert isinstance(out, LaunchSpec), out
    return out


def test_vllm_gets_lora_flags_and_the_runtime_api(tmp_path: Path) -> None:
    s = settings(tmp_path)
    a = shard("vllm", gpus=(0,), max_loras=4, max_lora_rank=8, max_cpu_loras=8)
    spec = spec_of(a, s)
    argv = " ".join(spec.argv)
    assert "--enable-lora --max-loras 4 --max-lora-rank 8 --max-cpu-loras 8" in argv
    assert spec.env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "True"
    assert spec.lora_url == "http://127.0.0.1:18000"
    # A rank vLLM does not take is rounded up to one it does.
    assert "--max-lora-rank 32" in " ".join(spec_of(a.model_copy(update={"max_lora_rank": 20}), s).argv)
    refused = launch_spec(a.model_copy(update={"max_lora_rank": 1024}), s)
    assert isinstance(refused, Refusal) and "max_lora_rank 1024" in refused.reason
    # The profile's own setting of the variable is kept.
    kept = spec_of(a.model_copy(update={"env": {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "1"}}), s)
    assert kept.env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "1"


def test_without_max_loras_nothing_changes(tmp_path: Path) -> None:
    spec = spec_of(shard("vllm", gpus=(0,)), settings(tmp_path))
    assert "--enable-lora" not in spec.argv and "VLLM_ALLOW_RUNTIME_LORA_UPDATING" not in spec.env
    assert spec.lora_url is None
    assert spec_of(shard("sim"), settings(tmp_path)).lora_url is None


def test_a_headless_follower_serves_no_lora_api(tmp_path: Path) -> None:
    a = shard("vllm", gpus=(0,), shard=1, shards=2, leader="10.0.0.1:8000", max_loras=2, max_lora_rank=16)
    spec = spec_of(a, settings(tmp_path, vllm="vllm"))
    assert "--enable-lora" in spec.argv and spec.lora_url is None


def test_the_simulator_gets_the_profiles_lora_options(tmp_path: Path) -> None:
    a = shard("sim", max_loras=2, max_lora_rank=8, max_cpu_loras=4, options={"lora_load_s": 0.5})
    spec = spec_of(a, settings(tmp_path))
    argv = " ".join(spec.argv)
    assert "--max-loras 2" in argv and "--max-lora-rank 8" in argv and "--max-cpu-loras 4" in argv
    assert "--lora-load-s 0.5" in argv
    assert spec.lora_url == "http://127.0.0.1:18000"
    # A simulated vLLM node runs the simulator with the same flags.
    sim_vllm = spec_of(
        shard("vllm", gpus=(0,), max_loras=2, max_lora_rank=8), settings(tmp_path, simulate_engines=True)
    )
    assert sim_vllm.simulated and "--max-loras" in sim_vllm.argv and sim_vllm.lora_url is not None


def test_llamacpp_serves_no_runtime_adapters(tmp_path: Path) -> None:
    gguf = tmp_path / "models" / "gemma.gguf"
    gguf.parent.mkdir()
    gguf.write_bytes(b"GGUF")
    spec = spec_of(shard("llamacpp", weights="gemma"), settings(tmp_path, model_dirs=[str(gguf.parent)]))
    assert spec.lora_url is None and not any("lora" in a for a in spec.argv)


# ---------------------------------------------------------------- storage


def safetensors(path: Path, payload: int = 8, cut: int = 0) -> None:
    header = json.dumps({"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, payload]}}).encode()
    path.write_bytes(struct.pack("<Q", len(header)) + header + b"\0" * (payload - cut))


def test_the_scan_reports_whole_adapter_directories_only(tmp_path: Path) -> None:
    models = tmp_path / "models"
    for name in ("whole", "nothing", "cut", "notjson"):
        (models / name).mkdir(parents=True)
        (models / name / "adapter_config.json").write_text('{"r": 8, "peft_type": "LORA"}')
    safetensors(models / "whole" / "adapter_model.safetensors")
    safetensors(models / "cut" / "adapter_model.safetensors", cut=4)
    (models / "notjson" / "adapter_config.json").write_text("{")
    safetensors(models / "notjson" / "adapter_model.safetensors")
    report = scan_model_dirs([str(models)], ())
    assert [w.name for w in report.weights] == ["whole"]
    assert report.weights[0].path == str(models / "whole")


# ---------------------------------------------------------------- one pass against an engine


async def one_pass(sync: AdapterSync, sh: Shard) -> tuple[tuple[str, ...], dict[str, str]]:
    sync.sync([sh])
    await asyncio.wait_for(sync.passes_done(), 10)
    return sync.report(sh.key)


def ready_shard(a: ShardAssignment, spec: LaunchSpec, tmp_path: Path) -> Shard:
    return Shard(assignment=a, spec=spec, log_path=tmp_path / "engine.log", state=ShardState.READY, pid=1)


async def test_a_replica_that_serves_no_adapters_says_so_per_adapter(tmp_path: Path) -> None:
    asked = (AdapterLoad(name="fr", weights="fr-lora"),)
    s = settings(tmp_path)
    sync = AdapterSync(s, lambda key: None)
    try:
        plain = shard("sim", adapters=asked)
        _, errors = await one_pass(sync, ready_shard(plain, spec_of(plain, s), tmp_path))
        assert errors == {"fr": "the base profile of gemma serves no adapters (it has no max_loras)"}
        gguf = tmp_path / "models" / "gemma.gguf"
        gguf.parent.mkdir()
        gguf.write_bytes(b"GGUF")
        s2 = settings(tmp_path, model_dirs=[str(gguf.parent)])
        llama = shard("llamacpp", weights="gemma", adapters=asked, replica_id="r2")
        _, errors = await one_pass(sync, ready_shard(llama, spec_of(llama, s2), tmp_path))
        assert errors["fr"].startswith("llama.cpp loads LoRA adapters only when its server starts")
    finally:
        await sync.aclose()


async def test_an_engine_without_the_runtime_api_and_one_with_it(tmp_path: Path) -> None:
    """A simulator without max_loras answers the load with vLLM's bare 404 (no runtime API); one with
    it loads, and the next pass after it dropped an adapter (a restart's loss) loads it again."""
    without = await start(SimOptions(port=0, zero=True))
    with_lora = await start(SimOptions(port=0, zero=True, max_loras=2))
    s = settings(tmp_path)
    current: dict[tuple[str, int], ShardAssignment] = {}
    sync = AdapterSync(s, current.get)
    asked = (AdapterLoad(name="fr", weights="/w/fr"),)
    try:
        a = shard("sim", port=without.port, max_loras=2, max_lora_rank=16, adapters=asked)
        spec = dataclasses.replace(spec_of(a, s), lora_url=without.url)
        _, errors = await one_pass(sync, ready_shard(a, spec, tmp_path))
        assert errors["fr"].startswith("the engine serves no runtime LoRA API")

        b = shard("sim", port=with_lora.port, max_loras=2, max_lora_rank=16, adapters=asked, replica_id="r2")
        sh = ready_shard(b, spec_of(b, s), tmp_path)
        assert await one_pass(sync, sh) == (("fr",), {})
        assert with_lora.engine.lora is not None
        with_lora.engine.lora.unload("fr")  # as a restarted engine holds none
        assert await one_pass(sync, sh) == (("fr",), {})
        # The assignment now asks for nothing (the supervisor's copy still lists fr): unloaded.
        current[sh.key] = b.model_copy(update={"adapters": ()})
        assert await one_pass(sync, sh) == ((), {})
        assert with_lora.engine.lora.loaded == {}
    finally:
        await sync.aclose()
        for srv in (without, with_lora):
            await srv.runner.cleanup()


@pytest.mark.slow
async def test_loads_go_side_by_side_and_a_change_meanwhile_gets_a_pass_at_once(tmp_path: Path) -> None:
    # 1 s a load: two side by side, and the third asked 0.3 s later starting at once (a pass does not
    # wait for its loads), take about 1.3 s; the third waiting for the first pass to end, 2 s; one after
    # another, or the third waiting for a tick, 3 s or more.
    srv = await start(SimOptions(port=0, zero=True, max_loras=4, lora_load_s=1.0))
    s = settings(tmp_path)
    current: dict[tuple[str, int], ShardAssignment] = {}
    sync = AdapterSync(s, current.get)
    fr, de, it = (AdapterLoad(name=n, weights=f"/w/{n}") for n in ("fr", "de", "it"))
    a = shard("sim", port=srv.port, max_loras=4, max_lora_rank=16, adapters=(fr, de))
    sh = ready_shard(a, spec_of(a, s), tmp_path)
    loop = asyncio.get_running_loop()
    try:
        t0 = loop.time()
        sync.sync([sh])
        await asyncio.sleep(0.3)
        current[sh.key] = a.model_copy(update={"adapters": (fr, de, it)})
        sync.sync([sh])  # the first pass is still loading
        await asyncio.wait_for(sync.passes_done(), 15)
        took = loop.time() - t0
        assert set(sync.report(sh.key)[0]) == {"fr", "de", "it"}
        assert 1.25 <= took < 1.85, took
    finally:
        await sync.aclose()
        await srv.runner.cleanup()


@pytest.mark.slow
async def test_each_load_and_unload_is_told_as_it_ends_and_a_pass_that_changes_nothing_is_not(
    tmp_path: Path,
) -> None:
    """``changed`` (the load feed's read_now) is told the replica as each load or unload ends, with the
    report already saying so: a request held for one adapter does not wait for the pass, nor for the
    next reading of the load."""
    srv = await start(SimOptions(port=0, zero=True, max_loras=4, lora_load_s=0.2))
    s = settings(tmp_path)
    current: dict[tuple[str, int], ShardAssignment] = {}
    told: list[tuple[tuple[str, int], frozenset[str], dict[str, str]]] = []
    sync: AdapterSync

    def changed(key: tuple[str, int]) -> None:
        loaded, errors = sync.report(key)
        told.append((key, frozenset(loaded), errors))

    sync = AdapterSync(s, current.get, changed=changed)
    fr, de = (AdapterLoad(name=n, weights=f"/w/{n}") for n in ("fr", "de"))
    a = shard("sim", port=srv.port, max_loras=4, max_lora_rank=16, adapters=(fr, de))
    sh = ready_shard(a, spec_of(a, s), tmp_path)
    try:
        sync.sync([sh])
        # Told before the pass ends: the first load done is reported while nothing else has changed.
        while not told:
            await asyncio.sleep(0.01)
        assert told[0][0] == sh.key and told[0][1] in ({"fr"}, {"de"}, {"fr", "de"})
        await asyncio.wait_for(sync.passes_done(), 10)
        assert [(k, names) for k, names, _ in told][-1] == (sh.key, frozenset({"fr", "de"}))
        assert 1 <= len(told) <= 2
        # A pass that changes nothing tells nothing.
        told.clear()
        assert set((await one_pass(sync, sh))[0]) == {"fr", "de"}
        assert told == []
        # An unload is told, and a load that fails with its error.
        bad = AdapterLoad(name="big", weights="/w/big", rank=32)
        current[sh.key] = a.model_copy(update={"adapters": (fr, bad)})
        loaded, errors = await one_pass(sync, sh)
        assert set(loaded) == {"fr"} and errors["big"].startswith("rank too large")
        assert told and told[-1][1] == {"fr"} and "big" in told[-1][2]
        # The engine lost one behind our back (a restart): what it lists is told, then the load again.
        told.clear()
        assert srv.engine.lora is not None
        srv.engine.lora.unload("fr")
        await one_pass(sync, sh)
        assert [names for _, names, _ in told] == [frozenset(), {"fr"}]
    finally:
        await sync.aclose()
        await srv.runner.cleanup()
