"""One dialect object per API family (dialects/dialect.py): what each family does its own way, pure.

The request path asks the route's dialect and never which API it serves; these pin what each family
answers, so a family that changes its mind shows here, not as a flag somewhere on the path.
"""

from __future__ import annotations

import json

from llmgw_common.apis import Api
from llmgw_common.messages import Endpoint, RoutingEndpoints
from llmgw_router.dialects.dialect import (
    AUDIO,
    CHAT,
    CHAT_BATCH,
    COMPLETIONS,
    MESSAGES,
    OPENAI,
    RESPONSES,
    parse_request,
)
from llmgw_router.dialects.routes import PROXIED
from llmgw_router.errors import RouterError, error_response
from llmgw_router.routing.endpoints import Pool, tag_of


def test_every_route_names_its_familys_dialect() -> None:
    by_api: dict[Api, set[str]] = {}
    for r in PROXIED:
        by_api.setdefault(r.api, set()).add(r.dialect.name)
    assert by_api[Api.RESPONSES] == {"responses"} and by_api[Api.MESSAGES] == {"messages"}
    assert by_api[Api.AUDIO] == {"audio"} and by_api[Api.EMBEDDINGS] == {"openai"}
    assert {r.path: r.dialect for r in PROXIED}["/v1/chat/completions/batch"] is CHAT_BATCH


def test_only_chat_and_completion_streams_are_continued() -> None:
    assert CHAT.continuation == "chat" and COMPLETIONS.continuation == "text"
    assert [d for d in (CHAT_BATCH, RESPONSES, MESSAGES, OPENAI, AUDIO) if d.continuation is not None] == []


def test_usage_in_streams_is_asked_for_or_always_sent() -> None:
    asked = {"stream_options": {"include_usage": True}}
    assert CHAT.usage_wanted(asked) and not CHAT.usage_wanted({}) and not CHAT.usage_wanted(None)
    assert not CHAT.usage_wanted({"stream_options": {"include_usage": "yes"}})
    # Their streams end with usage whatever the request says (response.completed, message_delta).
    assert RESPONSES.usage_wanted({}) and MESSAGES.usage_wanted(None)


def test_a_refusal_takes_the_familys_error_shape() -> None:
    err = error_response(429, "queue full", retry_after=3)
    openai = CHAT.refusal(err)
    assert json.loads(openai.body)["error"]["type"] == "rate_limit_error"
    anthropic = MESSAGES.refusal(err)
    assert json.loads(anthropic.body) == {
        "type": "error",
        "error": {"type": "rate_limit_error", "message": "queue full"},
    }
    assert anthropic.status == 429 and anthropic.headers["Retry-After"] == "3"
    gone = RouterError(408, "late", close=True)
    assert OPENAI.refusal(gone).will_close


def test_a_held_stream_ends_the_familys_way() -> None:
    body = b'{"error": {"message": "x"}}'
    assert CHAT.held_end(body, 503) == b'data: {"error": {"message": "x"}}\n\n'
    assert CHAT.held_end(b"{}", 200).endswith(b"data: [DONE]\n\n")
    assert MESSAGES.held_end(body, 503).startswith(b"event: error\ndata: ")
    assert b"[DONE]" not in MESSAGES.held_end(b"{}", 200)
    err = error_response(503, "nothing coming")
    assert json.loads(MESSAGES.held_error(err))["error"]["type"] == "overloaded_error"
    assert json.loads(CHAT.held_error(err))["error"]["code"] == "model_unavailable"


def _pool() -> Pool:
    p = Pool()
    p.set_endpoints(
        RoutingEndpoints(
            version=1,
            endpoints={"m": [Endpoint(replica_id="r1", model="m", url="http://127.0.0.1:1", node="n1")]},
        )
    )
    return p


def test_only_responses_pins_and_tags() -> None:
    pool = _pool()
    ep = pool.by_model["m"][0]
    tagged = f"resp_lg{ep.tag}abc"
    req = {"model": "m", "previous_response_id": tagged}
    assert CHAT.pin(pool, "m", dict(req)) is None
    assert CHAT.rewrite(b'{"id": "resp_1"}', ep.tag) == b'{"id": "resp_1"}' and CHAT.tagger(ep.tag) is None
    assert RESPONSES.pin(pool, "m", req) is ep and req["previous_response_id"] == "resp_abc"
    assert RESPONSES.rewrite(b'{"id": "resp_1"}', ep.tag) == f'{{"id": "resp_lg{ep.tag}1"}}'.encode()
    assert RESPONSES.tagger(ep.tag) is not None
    # A replica gone, or another model's: refused, never a guess at another replica.
    gone = RESPONSES.pin(pool, "m", {"previous_response_id": f"resp_lg{tag_of(7)}abc"})
    assert isinstance(gone, RouterError) and gone.status == 404
    other = RESPONSES.pin(pool, "x", {"previous_response_id": tagged})
    assert isinstance(other, RouterError) and other.status == 400


def test_the_json_parse_and_its_refusals() -> None:
    assert parse_request(b'{"model": "m", "stream": true}') == {"model": "m", "stream": True}
    assert "not valid JSON" in str(parse_request(b"{"))
    assert parse_request(b"[1]") == "the request body must be a JSON object"
    assert parse_request(b'{"model": ""}') == "you must provide a model parameter"
