"""The pure parts of the router's API surface: response-id tags, form fields, what a model serves."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from llmgw_common.apis import GENERATE_APIS, POOLING_APIS, Api, derived_apis
from llmgw_common.catalog import CatalogError, parse_catalog
from llmgw_router.dialects.forms import form_fields
from llmgw_router.dialects.stored import StreamTagger, tag_ids, untag
from llmgw_router.errors import error_response
from llmgw_router.routing.endpoints import tag_of

TAG = tag_of(0x0123456789ABCDEF)


def test_a_tagged_id_names_its_replica_and_gives_back_the_engines_id() -> None:
    body = json.dumps({"id": "resp_abc123", "previous_response_id": "resp_def", "object": "response"})
    tagged = json.loads(tag_ids(body.encode(), TAG))
    assert tagged["id"] == f"resp_lg{TAG}abc123"
    assert untag(tagged["id"]) == (TAG, "resp_abc123")
    assert untag(tagged["previous_response_id"]) == (TAG, "resp_def")


def test_ids_mentioned_in_generated_text_are_left_alone() -> None:
    text = 'the id was "resp_abc" and, "resp_x"'
    body = json.dumps({"output_text": text, "id": "resp_1"}).encode()
    out = json.loads(tag_ids(body, TAG))
    assert out["output_text"] == text and out["id"] == f"resp_lg{TAG}1"


@pytest.mark.parametrize(
    "rid", ["resp_abc", "resp_lg", f"resp_lg{TAG}", "resp_lg0123456789abcdeZ_x", "msg_" + TAG + "x", ""]
)
def test_ids_the_router_did_not_tag_are_not_read_as_tagged(rid: str) -> None:
    assert untag(rid) is None


@given(st.lists(st.integers(min_value=1, max_value=40), min_size=1, max_size=20))
def test_a_stream_split_anywhere_is_tagged_as_if_whole(cuts: list[int]) -> None:
    events = b"".join(
        b"event: response.created\ndata: "
        + json.dumps({"type": "response.created", "response": {"id": f"resp_{i:04d}"}}).encode()
        + b"\n\n"
        for i in range(5)
    )
    tagger = StreamTagger(TAG)
    out, at = b"", 0
    for n in cuts:
        out += tagger.feed(events[at : at + n])
        at += n
    out += tagger.feed(events[at:]) + tagger.flush()
    assert out == tag_ids(events, TAG)
    assert out.count(b'"resp_lg' + TAG.encode()) == 5


def _form(fields: dict[str, bytes], boundary: str = "b0und") -> bytes:
    parts = [
        f'--{boundary}\r\nContent-Disposition: form-data; name="{k}"'.encode()
        + (b'; filename="a.wav"\r\nContent-Type: audio/wav' if k == "file" else b"")
        + b"\r\n\r\n"
        + v
        + b"\r\n"
        for k, v in fields.items()
    ]
    return b"".join(parts) + f"--{boundary}--\r\n".encode()


def test_form_fields_are_read_without_decoding_the_file() -> None:
    body = _form({"file": b"\xff\x00" * 1000 + b"--b0un", "model": b"whisper", "stream": b"true"})
    assert form_fields(body, 'multipart/form-data; boundary="b0und"') == {
        "model": "whisper",
        "stream": "true",
    }


@pytest.mark.parametrize(
    ("body", "ctype", "problem"),
    [
        (_form({"model": b"w"}), "application/json", "multipart/form-data body"),
        (_form({"model": b"w"}), "multipart/form-data", "no boundary"),
        (_form({"file": b"x"}), "multipart/form-data; boundary=b0und", "form field named model"),
        (b"--b0und\r\nno head end", "multipart/form-data; boundary=b0und", "no headers"),
    ],
)
def test_bad_forms_say_what_is_wrong(body: bytes, ctype: str, problem: str) -> None:
    got = form_fields(body, ctype)
    assert isinstance(got, str) and problem in got, got


def test_what_an_engine_serves_follows_its_flags() -> None:
    assert derived_apis("vllm", (), {}) == GENERATE_APIS
    assert derived_apis("vllm", ("--runner", "pooling"), {}) == POOLING_APIS
    assert derived_apis("vllm", ("--runner=pooling",), {}) == POOLING_APIS
    assert derived_apis("vllm", ("--task", "embed"), {}) == POOLING_APIS
    assert Api.EMBEDDINGS not in derived_apis("llamacpp", ("-c", "512"), {})
    assert Api.MESSAGES in derived_apis("llamacpp", ("-c", "512"), {})
    assert derived_apis("llamacpp", ("--embeddings",), {}) == {Api.EMBEDDINGS, Api.TOKENIZE}
    assert derived_apis("llamacpp", ("--embedding", "--reranking"), {}) == {Api.RERANK, Api.TOKENIZE}
    assert derived_apis("sim", (), {"runner": "pooling"}) == POOLING_APIS
    assert derived_apis("sim", (), {}) == frozenset(Api)


def test_a_catalog_lists_apis_or_says_which_is_unknown() -> None:
    cat = parse_catalog({"models": [{"name": "e", "engine": "sim", "apis": ["embeddings", "rerank"]}]})
    assert cat.models[0].served == {Api.EMBEDDINGS, Api.RERANK}
    with pytest.raises(CatalogError) as e:
        parse_catalog(
            {
                "models": [
                    {"name": "a", "engine": "sim", "apis": ["chat", "chatt"]},
                    {"name": "b", "engine": "sim", "apis": []},
                ]
            }
        )
    text = str(e.value)
    assert "model 'a': apis.1" in text and "model 'b': apis is empty" in text


def test_an_anthropic_refusal_keeps_status_and_headers_in_anthropics_shape() -> None:
    err = error_response(429, "queue full", retry_after=3).response(anthropic=True)
    assert err.status == 429 and err.headers["Retry-After"] == "3"
    assert json.loads(err.body) == {
        "type": "error",
        "error": {"type": "rate_limit_error", "message": "queue full"},
    }
    assert (
        json.loads(error_response(503, "x").response(anthropic=True).body)["error"]["type"]
        == "overloaded_error"
    )
    assert json.loads(error_response(502, "x").response(anthropic=True).body)["error"]["type"] == "api_error"
