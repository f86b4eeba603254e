"""LoRA adapters on real vLLM through llmgw (issue 33): gemma with ``max_loras`` and the two adapters
``make vllm`` makes with peft (deterministic, non-zero). A request through the router for an adapter no
replica holds is held while the control plane asks a replica to load it and the agent loads it through
vLLM's runtime API; its answer is the adapter's: the same as vLLM's own answer with that adapter (asked
of the engine directly), and not the base's, nor the other adapter's. With both of the replica's slots
taken (max_loras 2), a third adapter takes the place of the one used least recently.

Last in name order, on a catalog of its own (gemma on one replica with LoRA on): one vLLM start, and no
module after it needs the default catalog back.
"""

from __future__ import annotations

import httpx
import pytest
import yaml

from tests.vllm.vllm_cluster import VllmCluster, endpoints, profile
from tests.vllm.vllm_kit import GEMMA, VllmInstall

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.xdist_group("vllm"), pytest.mark.timeout(1500)]

# What `make vllm` makes (deploy/vllm/make_lora.py): rank 8 on q_proj and v_proj, seeds 1 and 2. A third
# name for the first one's files: a third adapter for max_loras 2, whose answer must be the first's.
ADAPTERS = {
    "gemma-fr": "gemma-3-270m-lora-a",
    "gemma-de": "gemma-3-270m-lora-b",
    "gemma-fr2": "gemma-3-270m-lora-a",
}
CATALOG = yaml.safe_dump(
    {
        "models": [profile("gemma", GEMMA, replicas=1, max_loras=2, max_lora_rank=8)],
        "adapters": [{"name": n, "base": "gemma", "weights": w, "rank": 8} for n, w in ADAPTERS.items()],
    },
    sort_keys=False,
)
PROMPT = "The capital of France is"


@pytest.fixture
def lora_dirs(vllm_install: VllmInstall) -> dict[str, str]:
    """The adapters' directories, or a skip saying how to make them (before any cluster starts)."""
    dirs = {n: vllm_install.root / "models" / w for n, w in ADAPTERS.items()}
    for d in dirs.values():
        if not (d / "adapter_model.safetensors").is_file():
            pytest.skip(f"no LoRA adapter at {d}: run `make vllm` (it makes them with peft, cached)")
    return {n: str(d) for n, d in dirs.items()}


async def complete(http: httpx.AsyncClient, url: str, model: str, key: str | None = None) -> str:
    body = {"model": model, "prompt": PROMPT, "max_tokens": 10, "temperature": 0}
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    r = await http.post(f"{url}/v1/completions", json=body, headers=headers)
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["model"] == model
    text = out["choices"][0]["text"]
    assert isinstance(text, str) and text.strip()
    return text


async def test_an_adapters_answer_through_llmgw_is_vllms_own_and_a_third_takes_the_least_recent_slot(
    lora_dirs: dict[str, str], cluster: tuple[VllmCluster, str]
) -> None:
    c, key = cluster
    router = c.router_url()
    async with httpx.AsyncClient(timeout=600) as http:
        # Nothing holds it yet: held while it is loaded on gemma's replica, then answered.
        fr = await complete(http, router, "gemma-fr", key)
        engine = (await endpoints(c, "gemma", 1)).endpoints["gemma"][0].url
        cards = (await http.get(f"{engine}/v1/models")).json()["data"]
        assert ("gemma-fr", "gemma", lora_dirs["gemma-fr"]) in {
            (m["id"], m["parent"], m["root"]) for m in cards
        }
        # vLLM's own answer with that adapter, asked of the engine itself.
        assert await complete(http, engine, "gemma-fr") == fr
        base = await complete(http, router, "gemma", key)
        de = await complete(http, router, "gemma-de", key)
        assert len({fr, base, de}) == 3, (fr, base, de)
        assert await complete(http, engine, "gemma-de") == de
        models = (await http.get(f"{router}/v1/models", headers={"Authorization": f"Bearer {key}"})).json()[
            "data"
        ]
        assert {m["id"]: m.get("parent") for m in models if m["id"] in ADAPTERS} == dict.fromkeys(
            ADAPTERS, "gemma"
        )
        # Both slots (max_loras 2) are taken: a third adapter replaces the one used least recently
        # (gemma-fr), and answers as the files it shares with gemma-fr do.
        assert await complete(http, router, "gemma-fr2", key) == fr
        loaded = {m["id"] for m in (await http.get(f"{engine}/v1/models")).json()["data"]}
        assert loaded == {"gemma", "gemma-de", "gemma-fr2"}, loaded
