"""The splice against a hostile or broken continuation, pure: bounded memory, one ``[DONE]``."""

from __future__ import annotations

import json

import pytest

from llmgw_router.failover.continuation import DONE, MAX_TEXT_CHARS, Continue, Refuse, plan
from llmgw_router.failover.relay import HOLD_BYTES, Relay, Unframed


def _event(obj: dict[str, object]) -> bytes:
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


def _chunk(text: str, rid: str = "id-1") -> bytes:
    return _event(
        {
            "id": rid,
            "object": "chat.completion.chunk",
            "created": 1,
            "model": "m",
            "choices": [{"index": 0, "delta": {"content": text}, "finish_reason": None}],
        }
    )


def _spliced() -> Relay:
    """A relay whose first stream broke after two tokens and whose continuation has begun."""
    r = Relay()
    r.relay(_chunk("a") + _chunk(" b"))
    assert isinstance(plan("chat", {"model": "m", "messages": []}, r.fold()), Continue)
    r.splice()
    return r


def test_a_continuation_without_event_separators_is_not_held_without_bound() -> None:
    r = _spliced()
    piece = b"x" * 16 * 1024
    with pytest.raises(Unframed):
        for _ in range(4 * HOLD_BYTES // len(piece)):
            assert r.relay(piece) == b""
    # Nothing of it reaches the client, and what is held stays bounded.
    assert len(r._held) <= HOLD_BYTES
    # It cannot be continued again either: the next plan refuses.
    assert plan("chat", {"model": "m", "messages": []}, r.fold()).__class__.__name__ == "Refuse"


def test_a_continuation_that_sends_two_done_reaches_the_client_with_one() -> None:
    r = _spliced()
    out = r.relay(_chunk(" c", "id-2") + DONE + DONE + _chunk(" d", "id-2"))
    assert out.count(b"[DONE]") == 1 and out.endswith(DONE)
    assert b'" d"' not in out  # nothing after the end of the stream
    assert r.ended
    assert r.relay(DONE + _chunk(" e", "id-2")) == b""
    assert "".join(r.sent.text) == "a b c"


@pytest.mark.slow
def test_the_record_of_a_long_answer_is_compacted_not_one_string_per_token() -> None:
    r = Relay()
    for _ in range(50):
        r.relay(b"".join(_chunk("t") for _ in range(1000)))
    sent = r.fold()
    assert "".join(sent.text) == "t" * 50_000 and sent.tokens == 50_000
    # ~60 bytes of Python object per one-token string: 50,000 of them would be ~3 MB for 50 kB of text.
    assert len(sent.text) < 200


def test_an_answer_longer_than_the_record_keeps_is_not_continued_and_not_kept() -> None:
    r = Relay()
    piece = "x" * 4096
    for _ in range(MAX_TEXT_CHARS // len(piece) + 8):
        r.relay(_chunk(piece))
    sent = r.fold()
    assert sum(map(len, sent.text)) <= MAX_TEXT_CHARS
    step = plan("chat", {"model": "m", "messages": []}, sent)
    assert isinstance(step, Refuse) and "longer than" in step.reason


@pytest.mark.slow
def test_the_record_of_a_long_continuation_is_compacted_too() -> None:
    r = _spliced()
    for _ in range(50_000):
        r.relay(_chunk("t", "id-2"))  # one event per read, as a continuation usually arrives
    sent = r.fold()
    assert "".join(sent.text) == "a b" + "t" * 50_000
    assert len(sent.text) < 1000
