"""The simulator against the real thing: one set of requests to llmgw's sim-engine and to a real vLLM 0.32.

What a client can see is compared, not the generated text: the status, the content type, the set of
fields of every JSON body and their types (recursively; an empty list fits any list), error bodies'
shape and their ``type``/``param``, the SSE framing of a stream (the ``event:`` names in order, the
shape of each event's data, ``[DONE]`` where vLLM sends it; a run of events of one shape, the
tokens, counts once), and the metric names. Where they differ the simulator is wrong.

Two real engines, the session cluster's (vllm_stage.py), asked directly: Gemma 3 270M as a generate
model (with vLLM's response store on, ``VLLM_ENABLE_RESPONSES_API_STORE=1``) and all-MiniLM-L6-v2 as a
pooling model; each is paired with a simulator of the same runner and served name. Audio is not
compared: the ``make vllm`` install has no speech model.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from llmgw_sim.options import SimOptions
from tests.kit.poll import eventually_sync
from tests.llama.llama_kit import free_port
from tests.sim.sim_testkit import parse_sse
from tests.vllm.vllm_cluster import CATALOG
from tests.vllm.vllm_kit import MAX_MODEL_LEN
from tests.vllm.vllm_stage import ClusterStage

# A real vLLM takes 35 s to start on an idle box, several times that on a loaded one.
pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.xdist_group("vllm"), pytest.mark.timeout(900)]

GEN = "gemma"
POOL = "minilm"
# A prompt that a base model continues with words, and enough room for a few of them.
PROMPT = "The capital of France is Paris. The capital of Italy is"
TIMEOUT = httpx.Timeout(120.0)

# Fields whose null-ness depends on the generated text, not on the shape: a model that stops on
# one of its end-of-turn tokens reports that token id as the stop reason, the simulator never does.
CONTENT_DEPENDENT = (re.compile(r"(^|\.)stop_reason$"),)


# ---------------------------------------------------------------- the servers


@dataclass
class Pair:
    """A real vLLM and the simulator standing in for it."""

    real: str
    sim: str


_SIM_MAIN = """
import asyncio, json, sys
from llmgw_sim.serving import serve
from llmgw_sim.options import SimOptions
asyncio.run(serve(SimOptions.from_dict(json.loads(sys.argv[1])), asyncio.Event()))
"""


@dataclass
class SimProcess:
    proc: subprocess.Popen[bytes]
    url: str

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        if self.proc.stdout is not None:
            self.proc.stdout.close()


def start_sim(opts: SimOptions, log: Path) -> SimProcess:
    """The simulator in a process of its own (its options as a catalog gives them, every one).

    Only its address is read from stdout; its log (and any warning, which may come first) goes to
    ``log``."""
    with log.open("wb") as errf:
        proc = subprocess.Popen(
            [sys.executable, "-c", _SIM_MAIN, json.dumps(opts.to_dict())],
            stdout=subprocess.PIPE,
            stderr=errf,
            stdin=subprocess.DEVNULL,
        )
    assert proc.stdout is not None
    line = proc.stdout.readline().decode()
    m = re.search(r"listening on (http://\S+)", line)
    if m is None:
        proc.kill()
        proc.wait()
        raise AssertionError(f"the simulator did not start: {line!r}; its log: {log.read_text()}")
    return SimProcess(proc, m.group(1))


def _sim(name: str, max_len: int, pooling: bool, log: Path) -> SimProcess:
    opts = SimOptions(
        port=free_port(),
        model=name,
        runner="pooling" if pooling else "generate",
        ttft_ms=5,
        tokens_per_s=1000,
        max_model_len=max_len,
        default_max_tokens=8,
    )
    return start_sim(opts, log)


@pytest.fixture(scope="module")
def gen(vllm_stage: ClusterStage, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pair]:
    # The session cluster's gemma (the default catalog's: BASE_ARGS' --max-model-len, the response
    # store on), asked directly, and the simulator beside it.
    vllm_stage.serve(CATALOG)
    real = vllm_stage.engine_url(GEN)
    sim = _sim(GEN, MAX_MODEL_LEN, False, tmp_path_factory.mktemp("vllm-gen") / "sim.log")
    try:
        yield Pair(real=real, sim=sim.url)
    finally:
        sim.stop()


@pytest.fixture(scope="module")
def pool(vllm_stage: ClusterStage, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pair]:
    # The cluster's minilm: all-MiniLM-L6-v2 has 256 positions (vLLM refuses a longer --max-model-len).
    vllm_stage.serve(CATALOG)
    real = vllm_stage.engine_url(POOL)
    sim = _sim(POOL, 256, True, tmp_path_factory.mktemp("vllm-pool") / "sim.log")
    try:
        yield Pair(real=real, sim=sim.url)
    finally:
        sim.stop()


# ---------------------------------------------------------------- what a client sees


@dataclass
class Seen:
    status: int
    content_type: str
    body: Any  # the JSON body, or None
    events: list[tuple[str | None, Any]] | None  # an SSE body: (event name, data as JSON or "[DONE]")
    raw: str


def parse_events(text: str) -> list[tuple[str | None, Any]]:
    return [(e.event, e.data if e.data == "[DONE]" else json.loads(e.data)) for e in parse_sse(text.encode())]


def exchange(base: str, method: str, path: str, **kw: Any) -> Seen:
    with httpx.Client(timeout=TIMEOUT) as c:
        r = c.request(method, base + path, **kw)
    ctype = r.headers.get("content-type", "").split(";")[0].strip()
    text = r.text
    if ctype == "text/event-stream":
        return Seen(r.status_code, ctype, None, parse_events(text), text)
    try:
        body = json.loads(text) if text else None
    except ValueError:
        body = None
    return Seen(r.status_code, ctype, body, None, text)


def shape(value: Any) -> Any:
    """A JSON value's shape: its keys and leaf types, the first element standing for a list's."""
    if isinstance(value, dict):
        return {k: shape(v) for k, v in value.items()}
    if isinstance(value, list):
        return [shape(value[0])] if value else []
    if value is None:
        return None
    return type(value).__name__


def diff(real: Any, sim: Any, path: str = "") -> list[str]:
    """How the simulator's shape differs from vLLM's, one line per difference."""
    if isinstance(real, dict) and isinstance(sim, dict):
        out = [f"{path}.{k}: missing in the simulator" for k in real if k not in sim]
        out += [f"{path}.{k}: only in the simulator" for k in sim if k not in real]
        for k in real.keys() & sim.keys():
            out += diff(real[k], sim[k], f"{path}.{k}" if path else k)
        return sorted(out)
    if isinstance(real, list) and isinstance(sim, list):
        return diff(real[0], sim[0], path + "[]") if real and sim else []
    if real != sim:
        if (real is None or sim is None) and any(p.search(path) for p in CONTENT_DEPENDENT):
            return []
        return [f"{path or '(body)'}: vLLM {real!r}, simulator {sim!r}"]
    return []


def framing(events: list[tuple[str | None, Any]]) -> list[tuple[str | None, Any]]:
    """Event names and data shapes in order, a run of equal ones (the tokens) kept once."""
    out: list[tuple[str | None, Any]] = []
    for name, data in events:
        item = (name, data if data == "[DONE]" else shape(data))
        if not out or out[-1] != item:
            out.append(item)
    return out


def same(real: Seen, sim: Seen, *, error_fields: bool = True) -> list[str]:
    """Every difference a client could see between the two answers (empty: the same)."""
    out: list[str] = []
    if real.status != sim.status:
        out.append(f"status: vLLM {real.status}, simulator {sim.status} (vLLM said {real.raw[:300]!r})")
    if real.content_type != sim.content_type:
        out.append(f"content-type: vLLM {real.content_type!r}, simulator {sim.content_type!r}")
    if real.events is not None and sim.events is not None:
        fr, fs = framing(real.events), framing(sim.events)
        if [n for n, _ in fr] != [n for n, _ in fs]:
            out.append(f"event order: vLLM {[n for n, _ in fr]}, simulator {[n for n, _ in fs]}")
        for i, ((_, dr), (_, ds)) in enumerate(zip(fr, fs, strict=False)):
            out += [f"event {i}: {d}" for d in diff(dr, ds)]
        if (real.events[-1][1] == "[DONE]") != (sim.events[-1][1] == "[DONE]"):
            out.append(f"[DONE]: vLLM ends with {real.events[-1]!r}, simulator with {sim.events[-1]!r}")
        return out
    out += diff(shape(real.body), shape(sim.body))
    err_r, err_s = _error(real.body), _error(sim.body)
    if error_fields and err_r is not None and err_s is not None:
        for k in ("type", "param", "code"):
            if err_r.get(k) != err_s.get(k):
                out.append(f"error.{k}: vLLM {err_r.get(k)!r}, simulator {err_s.get(k)!r}")
    return out


def _error(body: Any) -> dict[str, Any] | None:
    if isinstance(body, dict) and isinstance(body.get("error"), dict):
        return body["error"]  # type: ignore[no-any-return]
    return None


def both(pair: Pair, method: str, path: str, **kw: Any) -> tuple[Seen, Seen]:
    return exchange(pair.real, method, path, **kw), exchange(pair.sim, method, path, **kw)


def check(pair: Pair, method: str, path: str, **kw: Any) -> tuple[Seen, Seen]:
    real, sim = both(pair, method, path, **kw)
    problems = same(real, sim)
    assert not problems, f"{method} {path}: the simulator differs from vLLM:\n  " + "\n  ".join(problems)
    return real, sim


# ---------------------------------------------------------------- the generate model

CHAT = {"model": GEN, "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 5, "ignore_eos": True}
GEN_CASES: list[tuple[str, str, str, dict[str, Any]]] = [
    ("models", "GET", "/v1/models", {}),
    ("health", "GET", "/health", {}),
    ("chat", "POST", "/v1/chat/completions", {"json": CHAT}),
    (
        "chat stream",
        "POST",
        "/v1/chat/completions",
        {"json": {**CHAT, "stream": True, "stream_options": {"include_usage": True}}},
    ),
    ("chat stream no usage", "POST", "/v1/chat/completions", {"json": {**CHAT, "stream": True}}),
    ("chat unknown model", "POST", "/v1/chat/completions", {"json": {**CHAT, "model": "nope"}}),
    ("chat no messages", "POST", "/v1/chat/completions", {"json": {"model": GEN}}),
    (
        "chat bad json",
        "POST",
        "/v1/chat/completions",
        {"content": b'{"model": ', "headers": {"Content-Type": "application/json"}},
    ),
    (
        "chat not json",
        "POST",
        "/v1/chat/completions",
        {"content": b"{}", "headers": {"Content-Type": "text/plain"}},
    ),
    ("chat a list", "POST", "/v1/chat/completions", {"json": ["x"]}),
    ("chat max_tokens 0", "POST", "/v1/chat/completions", {"json": {**CHAT, "max_tokens": 0}}),
    ("chat GET", "GET", "/v1/chat/completions", {}),
    (
        "completions",
        "POST",
        "/v1/completions",
        {"json": {"model": GEN, "prompt": PROMPT, "max_tokens": 5, "ignore_eos": True}},
    ),
    (
        "completions stream",
        "POST",
        "/v1/completions",
        {
            "json": {
                "model": GEN,
                "prompt": PROMPT,
                "max_tokens": 5,
                "ignore_eos": True,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
        },
    ),
    (
        "chat batch",
        "POST",
        "/v1/chat/completions/batch",
        {
            "json": {
                "model": GEN,
                "messages": [[{"role": "user", "content": PROMPT}], [{"role": "user", "content": "Hello"}]],
                "max_tokens": 4,
                "ignore_eos": True,
            }
        },
    ),
    (
        "responses",
        "POST",
        "/v1/responses",
        {"json": {"model": GEN, "input": PROMPT, "max_output_tokens": 5, "ignore_eos": True}},
    ),
    (
        "responses stream",
        "POST",
        "/v1/responses",
        {"json": {"model": GEN, "input": PROMPT, "max_output_tokens": 5, "ignore_eos": True, "stream": True}},
    ),
    ("responses no input", "POST", "/v1/responses", {"json": {"model": GEN}}),
    (
        "responses unknown previous",
        "POST",
        "/v1/responses",
        {
            "json": {
                "model": GEN,
                "input": "x",
                "previous_response_id": "resp_0123456789abcdef0123456789abcdef",
            }
        },
    ),
    ("responses get unknown", "GET", "/v1/responses/resp_0123456789abcdef0123456789abcdef", {}),
    ("responses cancel unknown", "POST", "/v1/responses/resp_0123456789abcdef0123456789abcdef/cancel", {}),
    (
        "messages",
        "POST",
        "/v1/messages",
        {"json": {"model": GEN, "max_tokens": 5, "messages": [{"role": "user", "content": PROMPT}]}},
    ),
    (
        "messages stream",
        "POST",
        "/v1/messages",
        {
            "json": {
                "model": GEN,
                "max_tokens": 5,
                "stream": True,
                "messages": [{"role": "user", "content": PROMPT}],
            }
        },
    ),
    (
        "messages unknown model",
        "POST",
        "/v1/messages",
        {"json": {"model": "nope", "max_tokens": 5, "messages": [{"role": "user", "content": "x"}]}},
    ),
    (
        "messages no max_tokens",
        "POST",
        "/v1/messages",
        {"json": {"model": GEN, "messages": [{"role": "user", "content": "x"}]}},
    ),
    (
        "count tokens",
        "POST",
        "/v1/messages/count_tokens",
        {"json": {"model": GEN, "messages": [{"role": "user", "content": PROMPT}]}},
    ),
    ("tokenize", "POST", "/tokenize", {"json": {"model": GEN, "prompt": PROMPT}}),
    (
        "tokenize chat",
        "POST",
        "/tokenize",
        {"json": {"model": GEN, "messages": [{"role": "user", "content": "hi"}]}},
    ),
    ("tokenize unknown model", "POST", "/tokenize", {"json": {"model": "nope", "prompt": "x"}}),
    ("detokenize", "POST", "/detokenize", {"json": {"model": GEN, "tokens": [2, 651, 6037]}}),
    ("embeddings on a generate model", "POST", "/v1/embeddings", {"json": {"model": GEN, "input": "x"}}),
    ("pooling on a generate model", "POST", "/pooling", {"json": {"model": GEN, "input": "x"}}),
    (
        "rerank on a generate model",
        "POST",
        "/v1/rerank",
        {"json": {"model": GEN, "query": "q", "documents": ["d"]}},
    ),
    ("unknown path", "GET", "/v1/nothing", {}),
]


@pytest.mark.parametrize(("name", "method", "path", "kw"), GEN_CASES, ids=[c[0] for c in GEN_CASES])
def test_generate_model_answers_as_vllm(
    gen: Pair, name: str, method: str, path: str, kw: dict[str, Any]
) -> None:
    check(gen, method, path, **kw)


def test_a_stored_response_is_retrieved_continued_and_not_cancelled_as_vllms(gen: Pair) -> None:
    body = {"model": GEN, "input": PROMPT, "max_output_tokens": 4, "ignore_eos": True}
    real, sim = check(gen, "POST", "/v1/responses", json=body)
    ids = (real.body["id"], sim.body["id"])
    assert all(re.fullmatch(r"resp_[0-9a-f]{16}", i) for i in ids), ids
    got = [
        exchange(base, "GET", f"/v1/responses/{i}") for base, i in zip((gen.real, gen.sim), ids, strict=True)
    ]
    assert not same(got[0], got[1]), same(got[0], got[1])
    assert got[0].body == real.body and got[1].body == sim.body
    follow = [
        exchange(
            base, "POST", "/v1/responses", json={**body, "input": "and Spain?", "previous_response_id": i}
        )
        for base, i in zip((gen.real, gen.sim), ids, strict=True)
    ]
    assert not same(follow[0], follow[1]), same(follow[0], follow[1])
    assert follow[0].body["usage"]["input_tokens"] > real.body["usage"]["input_tokens"]
    assert follow[1].body["usage"]["input_tokens"] > sim.body["usage"]["input_tokens"]
    cancel = [
        exchange(base, "POST", f"/v1/responses/{i}/cancel")
        for base, i in zip((gen.real, gen.sim), ids, strict=True)
    ]
    problems = same(cancel[0], cancel[1])
    assert not problems, problems
    assert cancel[0].status == 400


def test_a_background_response_as_vllms(gen: Pair) -> None:
    body = {"model": GEN, "input": PROMPT, "max_output_tokens": 4, "ignore_eos": True, "background": True}
    real, sim = check(gen, "POST", "/v1/responses", json=body)
    assert real.body["status"] == sim.body["status"] == "queued"
    for seen, base in ((real, gen.real), (sim, gen.sim)):

        def done(base: str = base, rid: str = seen.body["id"]) -> bool:
            # A background answer stays "queued" until it is done; capped, it ends "incomplete".
            status: str = exchange(base, "GET", f"/v1/responses/{rid}").body["status"]
            return status not in ("queued", "in_progress")

        eventually_sync(done, timeout=120, every=0.5, what=f"the background response at {base}")
    finished = [
        exchange(s_base, "GET", f"/v1/responses/{s.body['id']}")
        for s, s_base in ((real, gen.real), (sim, gen.sim))
    ]
    assert not same(finished[0], finished[1]), same(finished[0], finished[1])
    assert finished[0].body["status"] == finished[1].body["status"] == "incomplete"


def metric_types(text: str) -> dict[str, str]:
    return dict(re.findall(r"^# TYPE (\S+) (\S+)$", text, re.M))


def metric_labels(text: str) -> dict[str, set[str]]:
    out: dict[str, set[str]] = {}
    for name, labels in re.findall(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)\{([^}]*)\} ", text, re.M):
        out.setdefault(name, set()).update(re.findall(r'(\w+)="', labels))
    return out


@pytest.mark.parametrize("which", ["gen", "pool"])
def test_metric_names_are_vllms(which: str, request: pytest.FixtureRequest) -> None:
    pair: Pair = request.getfixturevalue(which)
    real, sim = both(pair, "GET", "/metrics")
    assert real.status == sim.status == 200
    rt, st = metric_types(real.raw), metric_types(sim.raw)
    # The simulator exposes a few of vLLM's metrics: each must be vLLM's, of vLLM's type and labels.
    assert set(st) <= set(rt), f"not vLLM's: {sorted(set(st) - set(rt))}"
    assert {n: st[n] for n in st} == {n: rt[n] for n in st}
    rl, sl = metric_labels(real.raw), metric_labels(sim.raw)
    assert {n: sl[n] for n in sl} == {n: rl[n] for n in sl if n in rl}
    # What llmgw's load reports read.
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"):
        assert name in st and name in rt


# ---------------------------------------------------------------- the pooling model

POOL_CASES: list[tuple[str, str, str, dict[str, Any]]] = [
    ("models", "GET", "/v1/models", {}),
    ("embeddings", "POST", "/v1/embeddings", {"json": {"model": POOL, "input": ["hello world", "bye"]}}),
    (
        "embeddings base64",
        "POST",
        "/v1/embeddings",
        {"json": {"model": POOL, "input": "x", "encoding_format": "base64"}},
    ),
    ("embeddings token ids", "POST", "/v1/embeddings", {"json": {"model": POOL, "input": [101, 7592, 102]}}),
    ("embeddings no input", "POST", "/v1/embeddings", {"json": {"model": POOL}}),
    ("embeddings unknown model", "POST", "/v1/embeddings", {"json": {"model": "nope", "input": "x"}}),
    ("cohere embed", "POST", "/v2/embed", {"json": {"model": POOL, "texts": ["a b", "c"]}}),
    (
        "cohere embed types",
        "POST",
        "/v2/embed",
        {"json": {"model": POOL, "texts": ["a"], "embedding_types": ["float", "base64", "binary"]}},
    ),
    ("pooling", "POST", "/pooling", {"json": {"model": POOL, "input": "hello"}}),
    ("score", "POST", "/score", {"json": {"model": POOL, "queries": "q", "documents": ["d1", "d2"]}}),
    ("score v1 text_1", "POST", "/v1/score", {"json": {"model": POOL, "text_1": "q", "text_2": "d"}}),
    (
        "rerank",
        "POST",
        "/rerank",
        {"json": {"model": POOL, "query": "q", "documents": ["d1", "d2", "d3"], "top_n": 2}},
    ),
    ("rerank v1", "POST", "/v1/rerank", {"json": {"model": POOL, "query": "q", "documents": ["d1"]}}),
    ("rerank v2", "POST", "/v2/rerank", {"json": {"model": POOL, "query": "q", "documents": ["d1", "d2"]}}),
    ("rerank no query", "POST", "/rerank", {"json": {"model": POOL, "documents": ["d1"]}}),
    ("classify on an embedding model", "POST", "/classify", {"json": {"model": POOL, "input": "x"}}),
    ("chat on a pooling model", "POST", "/v1/chat/completions", {"json": {**CHAT, "model": POOL}}),
    ("responses on a pooling model", "POST", "/v1/responses", {"json": {"model": POOL, "input": "x"}}),
    (
        "messages on a pooling model",
        "POST",
        "/v1/messages",
        {"json": {"model": POOL, "max_tokens": 3, "messages": []}},
    ),
    ("tokenize", "POST", "/tokenize", {"json": {"model": POOL, "prompt": "hello world"}}),
]


@pytest.mark.parametrize(("name", "method", "path", "kw"), POOL_CASES, ids=[c[0] for c in POOL_CASES])
def test_pooling_model_answers_as_vllm(
    pool: Pair, name: str, method: str, path: str, kw: dict[str, Any]
) -> None:
    check(pool, method, path, **kw)


# ---------------------------------------------------------------- the comparison itself


def test_the_comparison_sees_a_difference() -> None:
    """Without a real vLLM: the comparison catches a missing field, a type, an event and [DONE]."""
    a = Seen(200, "application/json", {"id": "x", "n": 1, "l": [{"k": 1}]}, None, "")
    assert same(a, a) == []
    b = Seen(200, "application/json", {"id": "x", "n": 1.0, "l": [{"k": 1, "j": 2}]}, None, "")
    assert same(a, b) == ["l[].j: only in the simulator", "n: vLLM 'int', simulator 'float'"]
    c = Seen(404, "application/json", {"detail": "Not Found"}, None, "")
    assert same(a, c)[0].startswith("status: vLLM 200, simulator 404")
    s1 = Seen(
        200, "text/event-stream", None, parse_events("event: a\ndata: {}\n\nevent: b\ndata: {}\n\n"), ""
    )
    s2 = Seen(200, "text/event-stream", None, parse_events("event: a\ndata: {}\n\ndata: [DONE]\n\n"), "")
    problems = same(s1, s2)
    assert any(p.startswith("event order") for p in problems) and any("[DONE]" in p for p in problems)
