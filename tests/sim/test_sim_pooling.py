"""The simulated engine's pooling endpoints and the routes each runner serves."""

from __future__ import annotations

import base64
import math
import struct
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
import pytest

from llmgw_sim.pooling_api import class_probs, cosine, embedding_vector
from llmgw_sim.serving import Listening

MODEL = "sim-pool"
Engine = Callable[..., Awaitable[Listening]]
USAGE_KEYS = {
    "prompt_tokens",
    "total_tokens",
    "completion_tokens",
    "prompt_tokens_details",
    "completion_tokens_details",
}


@pytest.fixture
async def srv(engine: Engine) -> Listening:
    return await engine(model=MODEL, zero=True, embedding_dims=16, runner="pooling")


async def post(
    http: aiohttp.ClientSession, srv: Listening, path: str, body: dict[str, Any]
) -> tuple[int, Any]:
    async with http.post(srv.url + path, json=body) as r:
        return r.status, await r.json()


async def test_embeddings_have_vllms_fields(srv: Listening, http: aiohttp.ClientSession) -> None:
    status, got = await post(http, srv, "/v1/embeddings", {"model": MODEL, "input": ["a b", "c"]})
    assert status == 200
    assert got["id"].startswith("embd-") and got["object"] == "list" and got["model"] == MODEL
    assert isinstance(got["created"], int)
    assert [d["index"] for d in got["data"]] == [0, 1] and got["data"][0]["object"] == "embedding"
    assert got["data"][0]["embedding"] == pytest.approx(embedding_vector("a b", 16))
    assert set(got["usage"]) == USAGE_KEYS
    assert (got["usage"]["prompt_tokens"], got["usage"]["completion_tokens"]) == (3, 0)


async def test_embeddings_of_chat_messages(srv: Listening, http: aiohttp.ClientSession) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi you"}]}
    status, got = await post(http, srv, "/v1/embeddings", body)
    assert status == 200 and got["data"][0]["embedding"] == pytest.approx(embedding_vector("hi you", 16))


async def test_cohere_embed_by_type(srv: Listening, http: aiohttp.ClientSession) -> None:
    body = {
        "model": MODEL,
        "texts": ["one", "two words"],
        "embedding_types": ["float", "base64", "binary", "ubinary"],
    }
    status, got = await post(http, srv, "/v2/embed", body)
    assert status == 200
    assert got["id"].startswith("embd-") and got["response_type"] == "embeddings_by_type"
    assert got["texts"] == ["one", "two words"]
    assert got["meta"] == {
        "api_version": {"version": "2"},
        "billed_units": {"input_tokens": 3, "image_tokens": 0},
    }
    floats = got["embeddings"]["float"]
    assert floats[0] == pytest.approx(embedding_vector("one", 16))
    assert struct.unpack("<16f", base64.b64decode(got["embeddings"]["base64"][0])) == pytest.approx(floats[0])
    bits = "".join("1" if x >= 0 else "0" for x in floats[0])
    assert got["embeddings"]["ubinary"][0] == [int(bits[:8], 2), int(bits[8:], 2)]
    assert got["embeddings"]["binary"][0] == [int(bits[:8], 2) - 128, int(bits[8:], 2) - 128]
    status, err = await post(http, srv, "/v2/embed", {"model": MODEL})
    assert status == 400 and "One of texts, images, or inputs" in err["error"]["message"]


async def test_pooling_returns_the_task_vectors(srv: Listening, http: aiohttp.ClientSession) -> None:
    status, got = await post(http, srv, "/pooling", {"model": MODEL, "input": "x y"})
    assert status == 200 and got["id"].startswith("pooling-")
    assert got["data"][0]["object"] == "pooling"
    assert got["data"][0]["data"] == pytest.approx(embedding_vector("x y", 16))
    status, err = await post(http, srv, "/pooling", {"model": MODEL, "input": "x", "task": "classify"})
    assert status == 400 and err["error"]["param"] == "task"


async def test_score_in_each_spelling_and_rerank(srv: Listening, http: aiohttp.ClientSession) -> None:
    for a, b in (("queries", "documents"), ("queries", "items"), ("data_1", "data_2"), ("text_1", "text_2")):
        for path in ("/score", "/v1/score"):
            status, got = await post(http, srv, path, {"model": MODEL, a: "q", b: ["d1", "d2"]})
            assert status == 200, (path, a, b)
            assert got["id"].startswith("score-") and got["object"] == "list"
            assert [d["score"] for d in got["data"]] == pytest.approx(
                [cosine("q", "d1", 16), cosine("q", "d2", 16)]
            )
            assert got["data"][0]["object"] == "score"
    status, err = await post(
        http, srv, "/score", {"model": MODEL, "queries": ["a", "b"], "documents": ["c", "d", "e"]}
    )
    assert status == 400 and "1:1, 1:N or N:N" in err["error"]["message"]
    docs = ["d1", "d2", "d3"]
    expected = sorted(((cosine("q", d, 16), i) for i, d in enumerate(docs)), reverse=True)
    for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
        status, got = await post(
            http, srv, path, {"model": MODEL, "query": "q", "documents": docs, "top_n": 2}
        )
        assert status == 200
        assert set(got) == {"id", "model", "usage", "results"}
        assert set(got["usage"]) == {"prompt_tokens", "total_tokens"}
        assert [r["index"] for r in got["results"]] == [i for _, i in expected[:2]]
        assert got["results"][0]["document"] == {"text": docs[expected[0][1]], "multi_modal": None}


async def test_classify_model(engine: Engine, http: aiohttp.ClientSession) -> None:
    srv = await engine(model=MODEL, zero=True, runner="pooling", pooling_task="classify", num_labels=3)
    status, got = await post(http, srv, "/classify", {"model": MODEL, "input": ["good", "bad"]})
    assert status == 200 and got["id"].startswith("classify-")
    probs = class_probs("good", 3)
    assert math.isclose(sum(probs), 1.0)
    best = max(range(3), key=probs.__getitem__)
    assert got["data"][0] == {
        "index": 0,
        "label": f"LABEL_{best}",
        "probs": pytest.approx(probs),
        "num_classes": 3,
    }
    # A classify model with several labels has no embeddings and no scoring: vLLM's bare 404.
    for path in ("/v1/embeddings", "/score", "/rerank"):
        status, got = await post(http, srv, path, {"model": MODEL, "input": "x"})
        assert (status, got) == (404, {"detail": "Not Found"}), path
    single = await engine(model=MODEL, zero=True, runner="pooling", pooling_task="classify", num_labels=1)
    status, _ = await post(http, single, "/score", {"model": MODEL, "queries": "a", "documents": "b"})
    assert status == 200


async def test_a_pooling_model_does_not_generate(srv: Listening, http: aiohttp.ClientSession) -> None:
    # vLLM registers no generate route on a pooling runner: Starlette's bare 404 on each.
    for path in (
        "/v1/chat/completions",
        "/v1/completions",
        "/v1/responses",
        "/v1/messages",
        "/v1/chat/completions/batch",
    ):
        status, got = await post(
            http, srv, path, {"model": MODEL, "messages": [{"role": "user", "content": "x"}]}
        )
        assert (status, got) == (404, {"detail": "Not Found"}), path
    status, got = await post(http, srv, "/classify", {"model": MODEL, "input": "x"})
    assert (status, got) == (404, {"detail": "Not Found"})
    # Tokenizing is every runner's.
    status, got = await post(http, srv, "/tokenize", {"model": MODEL, "prompt": "a b"})
    assert status == 200 and got["count"] == 2


async def test_a_generate_model_does_not_pool(engine: Engine, http: aiohttp.ClientSession) -> None:
    srv = await engine(model=MODEL, zero=True, runner="generate")
    for path in (
        "/v1/embeddings",
        "/v2/embed",
        "/pooling",
        "/classify",
        "/score",
        "/v1/rerank",
        "/v1/audio/transcriptions",
    ):
        status, got = await post(http, srv, path, {"model": MODEL, "input": "x"})
        assert (status, got) == (404, {"detail": "Not Found"}), path
    status, _ = await post(
        http, srv, "/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}]}
    )
    assert status == 200


async def test_pooling_errors(srv: Listening, http: aiohttp.ClientSession) -> None:
    cases: list[tuple[str, dict[str, Any], int, str | None]] = [
        # vLLM names no param when a pooling endpoint refuses the model.
        ("/v1/embeddings", {"model": "nope", "input": "x"}, 404, None),
        ("/rerank", {"model": "nope", "query": "q", "documents": ["a"]}, 404, None),
        ("/classify", {"model": MODEL, "input": "x"}, 404, None),
        ("/rerank", {"model": MODEL, "documents": ["a"]}, 400, "body.query"),
        ("/rerank", {"model": MODEL, "query": "q", "documents": ["a"], "top_n": -1}, 400, "body.top_n"),
        ("/score", {"model": MODEL, "queries": "q"}, 400, "body.queries"),
        ("/pooling", {"model": MODEL}, 400, "body.input"),
    ]
    for path, body, code, param in cases:
        status, got = await post(http, srv, path, body)
        assert status == code, (path, got)
        if "error" in got:
            assert got["error"]["param"] == param and got["error"]["code"] == code
