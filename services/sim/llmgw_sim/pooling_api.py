"""vLLM 0.32's pooling endpoints: ``/v1/embeddings``, Cohere's ``/v2/embed``, ``/pooling``, ``/classify``,
``/score`` ``/v1/score`` and ``/rerank`` ``/v1/rerank`` ``/v2/rerank``.

The vectors are deterministic functions of the text (unit vectors from a hash), so a test can know
an answer without a model: a score is the cosine of two texts' vectors, class probabilities are a
softmax of the first ``num_labels`` coordinates. A pooling request takes a slot for the prompt's
prefill time (ttft) and nothing more, as a real pooling model does.
"""

from __future__ import annotations

import base64
import hashlib
import json
import math
import struct
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from llmgw_sim import errors
from llmgw_sim import openai_api as oai
from llmgw_sim import openai_bodies as bodies
from llmgw_sim.engine import Engine

_JSON = "application/json"


def embedding_vector(text: str, dims: int) -> list[float]:
    """A unit vector that depends only on ``text`` and ``dims``."""
    raw = hashlib.shake_256(text.encode()).digest(2 * dims)
    vec = [(v - 32767.5) / 32767.5 for v in struct.unpack(f"<{dims}H", raw)]
    norm = sum(x * x for x in vec) ** 0.5 or 1.0
    return [x / norm for x in vec]


def b64_floats(vec: list[float]) -> str:
    return base64.b64encode(struct.pack(f"<{len(vec)}f", *vec)).decode()


def cosine(a: str, b: str, dims: int) -> float:
    va, vb = embedding_vector(a, dims), embedding_vector(b, dims)
    return sum(x * y for x, y in zip(va, vb, strict=True))


def class_probs(text: str, labels: int) -> list[float]:
    logits = embedding_vector(text, max(labels, 2))[:labels]
    if labels == 1:
        return [1.0 / (1.0 + math.exp(-4.0 * logits[0]))]
    peak = max(logits)
    exps = [math.exp(4.0 * (x - peak)) for x in logits]
    total = sum(exps)
    return [x / total for x in exps]


def pooling_usage(prompt: int) -> dict[str, Any]:
    return bodies.usage(prompt, 0)


def _words(text: str) -> int:
    return len(text.split())


def read_inputs(body: dict[str, Any], field: str = "input") -> list[str]:
    """Texts of an ``input`` (a string, strings, token ids or lists of them) or of chat ``messages``."""
    raw = body.get(field)
    if raw is None and field == "input" and "messages" in body:
        return [" ".join(oai.message_words(body["messages"]))]
    if raw is None:
        raise errors.missing(field, body)
    if isinstance(raw, str):
        return [raw]
    if isinstance(raw, list) and raw and all(isinstance(s, str) for s in raw):
        return list(raw)
    if isinstance(raw, list) and raw and all(isinstance(t, int) and not isinstance(t, bool) for t in raw):
        return [" ".join(str(t) for t in raw)]
    if (
        isinstance(raw, list)
        and raw
        and all(isinstance(x, list) and all(isinstance(t, int) for t in x) for x in raw)
    ):
        return [" ".join(str(t) for t in x) for x in raw]
    if isinstance(raw, list) and not raw:
        # vLLM renders nothing and refuses the empty batch.
        raise errors.BadRequest("Input list must not be empty.", field)
    raise errors.invalid(field, "string_type", "Input should be a valid string", raw)


def _texts(value: Any, field: str) -> list[str]:
    """A score or rerank side: a text, or a list of texts (or content objects with a text)."""
    items = value if isinstance(value, list) else [value]
    out: list[str] = []
    for v in items:
        if isinstance(v, str):
            out.append(v)
        elif isinstance(v, dict) and isinstance(v.get("content"), list):
            out.append(" ".join(p.get("text", "") for p in v["content"] if isinstance(p, dict)))
        else:
            raise errors.invalid(field, "string_type", "Input should be a valid string", v)
    return out


def score_pairs(body: dict[str, Any]) -> list[tuple[str, str]]:
    """The (query, document) pairs of a score request, in any of vLLM's four spellings."""
    for a, b in (("queries", "documents"), ("queries", "items"), ("data_1", "data_2"), ("text_1", "text_2")):
        if a in body and b in body:
            left, right = _texts(body[a], a), _texts(body[b], b)
            break
    else:
        raise errors.missing("queries", body)
    if len(left) == 1:
        return [(left[0], r) for r in right]
    if len(left) != len(right):
        raise errors.BadRequest("Input lengths must be either 1:1, 1:N or N:N", None)
    return list(zip(left, right, strict=True))


@dataclass(frozen=True, slots=True)
class Pooled:
    """What a pooling request computed: its response body and its prompt tokens."""

    body: dict[str, Any]
    prompt: int


def add(app: web.Application, engine: Engine) -> None:
    o = engine.opts
    if not o.pools:
        return
    api = PoolingRoutes(engine)
    app.router.add_post("/pooling", api.handler(api.pooling))
    if o.pools_for("embed"):
        app.router.add_post("/v1/embeddings", api.handler(api.embeddings))
        app.router.add_post("/v2/embed", api.handler(api.cohere_embed))
    if o.pools_for("classify"):
        app.router.add_post("/classify", api.handler(api.classify))
    if o.pools_for("score"):
        for path in ("/score", "/v1/score"):
            app.router.add_post(path, api.handler(api.score))
        for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
            app.router.add_post(path, api.handler(api.rerank))


class PoolingRoutes:
    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.dims = engine.opts.embedding_dims

    def handler(self, compute: Any) -> Any:
        """A route: read and check the body, hold a slot for the prefill, answer what ``compute`` made."""

        async def handle(request: web.Request) -> web.StreamResponse:
            return await self.engine.tracked(self._run(request, compute))

        return handle

    async def _run(self, request: web.Request, compute: Any) -> web.StreamResponse:
        e = self.engine
        try:
            body = await e.read_json(request)
            model = oai.model_of(body)
            # vLLM validates the body before it looks at the model.
            out: Pooled = compute(body)
        except errors.BadRequest as err:
            return errors.bad_request(err)
        refusal = e.refusal(model, param=None)
        if refusal is not None:
            return refusal
        async with e.slot(out.prompt):
            await e.prefill()
        resp = web.Response(body=json.dumps(out.body).encode(), content_type=_JSON)
        return await e.finish(request, resp, out.prompt, 0)

    def _head(self, kind: str) -> dict[str, Any]:
        e = self.engine
        return {"id": e.rid(kind), "object": "list", "created": e.now(), "model": e.opts.model}

    def _dims(self, body: dict[str, Any], field: str = "dimensions") -> int:
        dims = body.get(field)
        if dims is None:
            return self.dims
        if isinstance(dims, bool) or not isinstance(dims, int):
            raise errors.invalid(field, "int_type", "Input should be a valid integer", dims)
        if not 1 <= dims <= 65536:
            raise errors.BadRequest(f"dimensions must be in 1..65536, got {dims}.", field)
        return dims

    def embeddings(self, body: dict[str, Any]) -> Pooled:
        texts = read_inputs(body)
        dims = self._dims(body)
        fmt = body.get("encoding_format") or "float"
        if fmt not in ("float", "base64"):
            raise errors.invalid(
                "encoding_format",
                "literal_error",
                "Input should be 'float', 'base64', 'bytes' or 'bytes_only'",
                fmt,
            )
        data: list[dict[str, Any]] = []
        for i, text in enumerate(texts):
            vec = embedding_vector(text, dims)
            data.append(
                {"index": i, "object": "embedding", "embedding": b64_floats(vec) if fmt == "base64" else vec}
            )
        prompt = sum(map(_words, texts))
        return Pooled({**self._head("embd"), "data": data, "usage": pooling_usage(prompt)}, prompt)

    def cohere_embed(self, body: dict[str, Any]) -> Pooled:
        texts = body.get("texts")
        if texts is None and body.get("inputs") is None and body.get("images") is None:
            raise errors.BadRequest("One of texts, images, or inputs must be provided", None)
        if texts is not None:
            texts = _texts(texts, "texts")
        else:
            texts = _texts(body.get("inputs") or [], "inputs")
        dims = self._dims(body, "output_dimension")
        floats = [embedding_vector(t, dims) for t in texts]
        kinds = body.get("embedding_types") or ["float"]
        embeddings: dict[str, Any] = {}
        for kind in kinds:
            if kind == "float":
                embeddings["float"] = floats
            elif kind == "base64":
                embeddings["base64"] = [b64_floats(v) for v in floats]
            elif kind in ("binary", "ubinary"):
                embeddings[kind] = [_packed(v, signed=kind == "binary") for v in floats]
            else:
                raise errors.invalid(
                    "embedding_types",
                    "literal_error",
                    "Input should be 'float', 'binary', 'ubinary' or 'base64'",
                    kind,
                )
        prompt = sum(map(_words, texts))
        out: dict[str, Any] = {"id": self.engine.rid("embd"), "embeddings": embeddings}
        if body.get("texts") is not None:
            out["texts"] = texts
        out["meta"] = {
            "api_version": {"version": "2"},
            "billed_units": {"input_tokens": prompt, "image_tokens": 0},
        }
        out["response_type"] = "embeddings_by_type"
        return Pooled(out, prompt)

    def pooling(self, body: dict[str, Any]) -> Pooled:
        o = self.engine.opts
        task = body.get("task")
        mine = o.pooling_task if o.runner is not None else task or "embed"
        if task is not None and task != mine:
            raise errors.BadRequest(f"Unsupported task: {task!r} Supported tasks: {[mine]}", "task")
        texts = read_inputs(body)
        data: list[dict[str, Any]] = []
        for i, text in enumerate(texts):
            vec = class_probs(text, o.num_labels) if mine == "classify" else embedding_vector(text, self.dims)
            data.append({"index": i, "object": "pooling", "data": vec})
        prompt = sum(map(_words, texts))
        return Pooled({**self._head("pooling"), "data": data, "usage": pooling_usage(prompt)}, prompt)

    def classify(self, body: dict[str, Any]) -> Pooled:
        labels = self.engine.opts.num_labels
        texts = read_inputs(body)
        data: list[dict[str, Any]] = []
        for i, text in enumerate(texts):
            probs = class_probs(text, labels)
            best = max(range(labels), key=probs.__getitem__)
            data.append({"index": i, "label": f"LABEL_{best}", "probs": probs, "num_classes": labels})
        prompt = sum(map(_words, texts))
        return Pooled({**self._head("classify"), "data": data, "usage": pooling_usage(prompt)}, prompt)

    def score(self, body: dict[str, Any]) -> Pooled:
        pairs = score_pairs(body)
        data = [
            {"index": i, "object": "score", "score": cosine(q, d, self.dims)}
            for i, (q, d) in enumerate(pairs)
        ]
        prompt = sum(_words(q) + _words(d) for q, d in pairs)
        return Pooled({**self._head("score"), "data": data, "usage": pooling_usage(prompt)}, prompt)

    def rerank(self, body: dict[str, Any]) -> Pooled:
        if "query" not in body:
            raise errors.missing("query", body)
        if "documents" not in body:
            raise errors.missing("documents", body)
        (query,) = _texts(body["query"], "query")[:1] or [""]
        docs = _texts(body["documents"], "documents")
        top_n = body.get("top_n", 0)
        if isinstance(top_n, bool) or not isinstance(top_n, int) or top_n < 0:
            raise errors.invalid(
                "top_n", "greater_than_equal", "Input should be greater than or equal to 0", top_n
            )
        results: list[dict[str, Any]] = [
            {
                "index": i,
                "document": {"text": d, "multi_modal": None},
                "relevance_score": cosine(query, d, self.dims),
            }
            for i, d in enumerate(docs)
        ]
        results.sort(key=lambda r: r["relevance_score"], reverse=True)
        if 0 < top_n < len(results):
            results = results[:top_n]
        prompt = sum(_words(query) + _words(d) for d in docs)
        out = {
            "id": self.engine.rid("score"),
            "model": self.engine.opts.model,
            "usage": {"prompt_tokens": prompt, "total_tokens": prompt},
            "results": results,
        }
        return Pooled(out, prompt)


def _packed(vec: list[float], signed: bool) -> list[int]:
    """Cohere's binary embeddings: a bit per coordinate (>= 0), eight per byte, most significant first."""
    if len(vec) % 8:
        raise errors.BadRequest(
            f"Embedding dimension must be a multiple of 8 for binary embedding types, but got {len(vec)}.",
            None,
        )
    out: list[int] = []
    for i in range(0, len(vec), 8):
        byte = 0
        for x in vec[i : i + 8]:
            byte = (byte << 1) | (x >= 0)
        out.append(byte - 128 if signed else byte)
    return out
