"""The splice of a continued stream, pure: relayed by whole events, rewritten, nothing lost or repeated.

Streams are rendered by the simulated engine's own writer, whose answer continued from any point is the
rest of the uninterrupted answer, so a spliced stream must equal the uninterrupted one byte for byte.
"""

from __future__ import annotations

import itertools
import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from llmgw_router.failover.continuation import (
    DONE,
    Close,
    Continue,
    Kind,
    Refuse,
    Sent,
    plan,
    request_blocker,
)
from llmgw_router.failover.relay import Relay
from llmgw_sim import openai_api as oai
from llmgw_sim.openai_bodies import ChunkWriter

PATHS: dict[Kind, str] = {"chat": "/v1/chat/completions", "text": "/v1/completions"}


def _request(kind: Kind, prompt: str, max_tokens: int | None, usage: bool) -> dict[str, Any]:
    req: dict[str, Any] = {"model": "m", "stream": True}
    if kind == "chat":
        req["messages"] = [{"role": "system", "content": "be brief"}, {"role": "user", "content": prompt}]
    else:
        req["prompt"] = prompt
    if max_tokens is not None:
        req["max_tokens"] = max_tokens
    if usage:
        req["stream_options"] = {"include_usage": True}
    return req


def _render(kind: Kind, req: dict[str, Any], rid: str, created: int) -> bytes:
    """The engine's whole stream for ``req``, as the simulator sends it."""
    read = oai.read_chat if kind == "chat" else oai.read_completion
    g = read(req, 16)
    w = ChunkWriter(rid, created, g, kind == "chat")
    tokens = oai.completion_tokens(g)
    return (w.first() + "".join(map(w.token, tokens)) + w.end(len(tokens))).encode()


def _inside_token(stream: bytes, i: int) -> int:
    """A point inside the event of the stream's ``i``-th token (from 0): a break there loses that token."""
    at = -1
    for _ in range(i + 1):
        at = stream.index(b'"index": 0, "delta": {"content": ', at + 1)
    return at + 10


def _events(data: bytes) -> list[dict[str, Any] | str]:
    out: list[dict[str, Any] | str] = []
    for e in data.split(b"\n\n"):
        if e:
            payload = e.removeprefix(b"data: ")
            out.append("[DONE]" if payload == b"[DONE]" else json.loads(payload))
    return out


def _splice(kind: Kind, req: dict[str, Any], pieces: list[bytes], later: int = 1) -> tuple[bytes, Relay, Any]:
    """Relay ``pieces`` of a stream that then breaks; continue it as planned; return what the client got."""
    r = Relay()
    out = b"".join(r.relay(p) for p in pieces)
    step = plan(kind, req, r.fold())
    if isinstance(step, Continue):
        r.splice()
        cont = _render(kind, json.loads(step.body), "other-id", 999)
        # The continuation arrives in awkward pieces too.
        out += b"".join(r.relay(cont[i : i + later * 37]) for i in range(0, len(cont), later * 37))
    elif isinstance(step, Close):
        out += step.tail
    return out, r, step


# ---------------------------------------------------------------- table-driven


def test_partial_event_is_held_back_until_its_end() -> None:
    r = Relay()
    assert r.relay(b'data: {"a": 1}\n\ndata: {"b"') == b'data: {"a": 1}\n\n'
    assert r.relay(b": 2}\n") == b""
    assert r.relay(b"\n") == b'data: {"b": 2}\n\n'
    assert not r.ended
    assert r.relay(DONE) == DONE and r.ended


@pytest.mark.parametrize("kind", ["chat", "text"])
def test_continuation_request_carries_the_text_sent(kind: Kind) -> None:
    req = _request(kind, "alpha beta gamma", 10, usage=False)
    whole = _render(kind, req, "id-1", 1)
    # Two whole token events (after the chat role announcement), then part of the third.
    n_whole = 3 if kind == "chat" else 2
    cut = sum(len(e) + 2 for e in whole.split(b"\n\n")[:n_whole]) + 10
    r = Relay()
    r.relay(whole[:cut])
    sent = r.fold()
    read = oai.read_chat if kind == "chat" else oai.read_completion
    two = "".join(oai.completion_tokens(read(req, 16))[:2])
    assert "".join(sent.text) == two
    step = plan(kind, req, sent)
    assert isinstance(step, Continue)
    body = json.loads(step.body)
    assert body["max_tokens"] == 8
    if kind == "chat":
        assert body["messages"][-1] == {"role": "assistant", "content": two}
        assert body["continue_final_message"] is True and body["add_generation_prompt"] is False
    else:
        assert body["prompt"] == "alpha beta gamma" + two
    # The client's request is not changed by planning.
    assert req["max_tokens"] == 10 and "continue_final_message" not in req


@pytest.mark.parametrize(
    ("kind", "req", "reason"),
    [
        ("chat", {"messages": [], "n": 2}, "n > 1"),
        ("text", {"prompt": ["a", "b"]}, "one string"),
        ("text", {"prompt": "a", "echo": True}, "echo"),
        # vLLM's chat echo would repeat the partial answer it is asked to continue.
        ("chat", {"messages": [], "echo": True}, "echo"),
        ("chat", {"messages": "hi"}, "no messages"),
        ("chat", {"messages": [], "n": 1}, ""),
    ],
    ids=["n2", "prompt-list", "echo", "chat-echo", "no-messages", "n1"],
)
def test_request_blockers(kind: Kind, req: dict[str, Any], reason: str) -> None:
    got = request_blocker(kind, req)
    assert (reason in got) if reason else got == ""


@pytest.mark.parametrize(
    ("event", "reason"),
    [
        ({"choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0, "id": "t"}]}}]}, "tool calls"),
        ({"choices": [{"index": 1, "delta": {"content": "x"}}]}, "several choices"),
        ({"choices": [{"index": 0, "delta": {"reasoning_content": "hmm"}}]}, "reasoning"),
    ],
    ids=["tool-calls", "second-choice", "reasoning"],
)
def test_answers_that_cannot_be_continued(event: dict[str, Any], reason: str) -> None:
    r = Relay()
    r.relay(b"data: " + json.dumps({"id": "a", **event}).encode() + b"\n\n")
    step = plan("chat", {"messages": []}, r.fold())
    assert isinstance(step, Refuse) and reason in step.reason


def test_cut_after_the_last_token_ends_with_a_length_finish() -> None:
    req = _request("chat", "a b", 3, usage=False)
    whole = _render("chat", req, "id-1", 1)
    cut = whole.index(b'"finish_reason": "length"') - 60
    out, _, step = _splice("chat", req, [whole[: whole.rindex(b"data:", 0, cut)]])
    assert isinstance(step, Close)
    assert out == whole


def test_usage_adds_up_across_two_migrations() -> None:
    req = _request("chat", "one two three", 12, usage=True)
    whole = _render("chat", req, "id-1", 1)
    r = Relay()
    out = r.relay(whole[: _inside_token(whole, 4)])
    for breaks_again in (True, False):  # second break: two more words into the continuation
        step = plan("chat", req, r.fold())
        assert isinstance(step, Continue)
        r.splice()
        cont = _render("chat", json.loads(step.body), "x", 5)
        out += r.relay(cont[: _inside_token(cont, 2)] if breaks_again else cont)
    assert out == whole
    assert r.sent.usage == (5, 12)  # system + user words; all twelve tokens


def test_a_stream_that_broke_before_any_whole_event_is_started_again() -> None:
    req = _request("chat", "a b", 4, usage=True)
    whole = _render("chat", req, "id-1", 1)
    out, _r, step = _splice("chat", req, [whole[:10]])
    assert isinstance(step, Continue) and json.loads(step.body) == req
    # The client sees only the second engine's stream, consistently under its id.
    assert out == whole.replace(b"id-1", b"other-id").replace(b'"created": 1,', b'"created": 999,')


def test_sent_record_reads_role_text_finish() -> None:
    s = Sent()
    s.observe({"id": "a", "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]})
    s.observe({"id": "b", "choices": [{"index": 0, "delta": {"content": "hi"}, "finish_reason": "stop"}]})
    assert (s.id, s.role, s.text, s.tokens, s.finished, s.blocker) == ("a", True, ["hi"], 1, True, "")


# ---------------------------------------------------------------- property


@settings(max_examples=300, deadline=None)
@given(
    kind=st.sampled_from(["chat", "text"]),
    words=st.lists(st.sampled_from(["a", "b", "cc", "ü", '"q"', "x\\y"]), min_size=1, max_size=12),
    max_tokens=st.one_of(st.none(), st.integers(1, 30)),
    usage=st.booleans(),
    data=st.data(),
)
@pytest.mark.slow
def test_any_cut_point_splices_to_the_uninterrupted_stream(
    kind: Kind, words: list[str], max_tokens: int | None, usage: bool, data: st.DataObject
) -> None:
    if kind == "text" and max_tokens is None:
        # The simulator cannot tell a completion's continued text from its prompt, so an uncapped one
        # runs its default length again (a real engine stops at its end-of-text token either way).
        max_tokens = 16
    req = _request(kind, " ".join(words), max_tokens, usage)
    whole = _render(kind, req, "id-1", 1)
    cut = data.draw(st.integers(1, len(whole) - 1), label="cut")
    splits = sorted(data.draw(st.lists(st.integers(1, cut), max_size=4), label="splits"))
    bounds = [0, *splits, cut]
    pieces = [whole[a:b] for a, b in itertools.pairwise(bounds)]
    out, r, step = _splice(kind, req, pieces, later=data.draw(st.integers(1, 5), label="later"))
    assert not isinstance(step, Refuse)
    expected = whole
    if b"id-1" not in out:  # nothing whole reached the client: the second stream is all it sees
        expected = whole.replace(b"id-1", b"other-id").replace(b'"created": 1,', b'"created": 999,')
    if isinstance(step, Close) and usage and r.sent.usage is None:
        # Cut after the last token: the usage event is not known to the router and is left out.
        usage_event = [e for e in expected.split(b"\n\n") if b'"choices": [], "usage"' in e]
        expected = expected.replace(usage_event[0] + b"\n\n", b"")
    assert out == expected
    evs = _events(out)
    assert evs.count("[DONE]") == 1 and evs[-1] == "[DONE]"
    finishes = [
        c["finish_reason"] for e in evs if isinstance(e, dict) for c in e["choices"] if c["finish_reason"]
    ]
    assert len(finishes) == 1


def _full_fold(blob: bytes) -> Sent:
    r = Relay()
    for event in blob.split(b"\n\n"):
        if event:
            r._observe(event)
    return r.sent


@settings(max_examples=300, deadline=None)
@given(
    kind=st.sampled_from(["chat", "text"]),
    words=st.lists(
        st.sampled_from(["a", "b", "ü", '"content": "x"', "\\", "text\\"]), min_size=1, max_size=8
    ),
    n=st.integers(1, 40),
    usage=st.booleans(),
    start=st.integers(0, 10_000),
    length=st.integers(1, 10_000),
)
@pytest.mark.slow
def test_fast_fold_reads_what_a_full_parse_reads(
    kind: Kind, words: list[str], n: int, usage: bool, start: int, length: int
) -> None:
    """Folding long streams by regular expressions: the same record as parsing every event."""
    whole = _render(kind, _request(kind, " ".join(words), n, usage), "id-1", 1)
    events = whole.split(b"\n\n")[:-1]
    part = b"".join(e + b"\n\n" for e in events[start % len(events) :][:length])
    r = Relay()
    r.relay(part)
    got = r.fold()
    want = _full_fold(part)
    # The text as one string: a fold keeps its text as one piece, not one per token.
    assert ("".join(got.text), got.tokens, got.role, got.finished, got.done, got.id) == (
        "".join(want.text), want.tokens, want.role, want.finished, want.done, want.id,
    )  # fmt: skip
    assert got.usage == want.usage and got.blocker == want.blocker == ""


def test_fast_fold_is_taken_for_text_events_and_not_for_others() -> None:
    from llmgw_router.failover.relay import _plain

    whole = _render("chat", _request("chat", "a b", 5, False), "id-1", 1)
    body = whole[whole.index(b"\n\n") + 2 :]
    assert _plain(body)
    assert not _plain(body.replace(b'"index": 0', b'"index": 1', 1))
    assert not _plain(body + b'data: {"usage": {"prompt_tokens": 1}}\n\n')
    assert not _plain(body.replace(b"\n\ndata: ", b"\n\nevent: x\ndata: ", 1))
    assert not _plain(b'data: {"choices": [{"delta": {"tool_calls": []}}]}\n\n')


def test_fast_fold_reads_raw_utf8_and_escapes() -> None:
    texts = ["Grüße", " 😀", ' "quoted"', " back\\slash", "\n"]
    events = [
        {"id": "a", "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]},
        *(
            {"id": "a", "choices": [{"index": 0, "delta": {"content": t}, "finish_reason": None}]}
            for t in texts
        ),
    ]
    blob = b"".join(b"data: " + json.dumps(e, ensure_ascii=False).encode() + b"\n\n" for e in events)
    r = Relay()
    r.relay(blob)
    assert "".join(r.fold().text) == "".join(texts) and r.sent.tokens == len(texts)


def test_bytes_that_are_not_blank_line_separated_events_pass_through() -> None:
    r = Relay()
    crlf = b'data: {"id": "a", "choices": []}\r\n\r\n' * 3000  # no "\n\n" anywhere
    assert r.relay(crlf[:1000]) == b""  # held: it may still become an event
    assert r.relay(crlf[1000:]) == crlf  # past HOLD_BYTES: everything goes, and so does the rest
    assert r.through and r.relay(b"more") == b"more"
    assert isinstance(plan("chat", {"messages": []}, r.fold()), Refuse)


@settings(max_examples=200, deadline=None)
@given(
    kind=st.sampled_from(["chat", "text"]),
    words=st.lists(st.sampled_from(["a", "b", "cc", "ü"]), min_size=1, max_size=8),
    max_tokens=st.integers(1, 30),
    usage=st.booleans(),
    data=st.data(),
)
@pytest.mark.slow
def test_a_continuation_that_breaks_too_is_continued_again(
    kind: Kind, words: list[str], max_tokens: int, usage: bool, data: st.DataObject
) -> None:
    req = _request(kind, " ".join(words), max_tokens, usage)
    whole = _render(kind, req, "id-1", 1)
    r = Relay()
    out = r.relay(whole[: data.draw(st.integers(1, len(whole) - 1), label="cut1")])
    step = plan(kind, req, r.fold())
    if not isinstance(step, Continue):
        return  # nothing to continue: the single-break test covers it
    r.splice()
    second = _render(kind, json.loads(step.body), "id-2", 2)
    out += r.relay(second[: data.draw(st.integers(1, len(second) - 1), label="cut2")])
    step = plan(kind, req, r.fold())
    if isinstance(step, Continue):
        r.splice()
        out += r.relay(_render(kind, json.loads(step.body), "id-3", 3))
    else:
        assert isinstance(step, Close)
        out += step.tail
    first = out[out.index(b'"id": "') + 7 :][:4]  # the id the client saw first names the stream
    expected = whole.replace(b"id-1", first).replace(b'"created": 1,', b'"created": ' + first[-1:] + b",")
    if isinstance(step, Close) and usage and r.sent.usage is None:
        usage_event = [e for e in expected.split(b"\n\n") if b'"choices": [], "usage"' in e]
        expected = expected.replace(usage_event[0] + b"\n\n", b"")
    assert out == expected
