"""One object per API family: what a family does its own way, so the request path never asks which API
it serves.

A family's :class:`Dialect` parses its body (JSON, or a form's fields), renders the router's refusals
in its error shape, ends a held stream its way, says whether a stream's usage is sent, pins a stored
response to its replica and rewrites the ids of the responses an answer carries, and names the kind of
continuation its streams take when an engine dies mid-stream. The route table (``routes.py``) names
each path's dialect, as data.
"""

from __future__ import annotations

import json
from typing import Any

from llmgw_router.dialects.forms import form_fields
from llmgw_router.dialects.stored import StreamTagger, tag_ids, untag
from llmgw_router.errors import RouterError, error_response
from llmgw_router.failover.continuation import Kind
from llmgw_router.http.request import Request
from llmgw_router.http.response import Response
from llmgw_router.refusals import gone
from llmgw_router.routing.endpoints import EndpointState, Pool

_DECODER = json.JSONDecoder()

# A body as the request path reads it: (model, stream, the parsed JSON or None, Content-Type).
Parsed = tuple[str, bool, dict[str, Any] | None, bytes]
_JSON = b"application/json"


def parse_request(body: bytes) -> dict[str, Any] | str:
    """The request as a dict, or what is wrong with it (a 400 message)."""
    try:
        if body[:1] == b"{" and body[1:2] != b"\0":
            # What json.loads does with these bytes (json.detect_encoding says UTF-8 for them), minus
            # its checks and the detection: the same object, or the same error.
            obj = _DECODER.decode(body.decode("utf-8", "surrogatepass"))
        else:
            obj = json.loads(body)
    except (ValueError, UnicodeDecodeError) as e:
        return f"the request body is not valid JSON: {e}"
    except RecursionError:
        # json.loads recurses per nesting level: `[[[[...` 100,000 deep must be a 400, not a 500.
        return "the request body is not valid JSON: nested too deeply"
    if not isinstance(obj, dict):
        return "the request body must be a JSON object"
    model = obj.get("model")
    if not isinstance(model, str) or not model:
        return "you must provide a model parameter"
    return obj


class Dialect:
    """OpenAI's JSON API (embeddings, pooling, scores, tokenizing): the family every other one varies."""

    __slots__ = ("continuation", "name", "prompted", "salted")

    def __init__(
        self, name: str, continuation: Kind | None = None, *, prompted: bool = False, salted: bool = False
    ) -> None:
        self.name = name
        # How a stream broken after its first byte is continued on another replica (failover/);
        # None: it is not (the stream ends with a 502's worth of nothing more).
        self.continuation = continuation
        # Its body is an OpenAI chat or completion prompt, routed by its cached prefix (cache/).
        self.prompted = prompted
        # Its body takes vLLM's cache_salt: a key kept apart has its requests salted (tenancy/salt.py).
        self.salted = salted

    def __repr__(self) -> str:
        return f"Dialect({self.name})"

    def parse(self, body: bytes, request: Request) -> Parsed | RouterError:
        """``model`` and ``stream`` from the body, with its JSON when it is JSON; or the 400."""
        got = parse_request(body)
        if isinstance(got, str):
            return error_response(400, got, param=None if "JSON" in got else "model")
        return got["model"], got.get("stream") is True, got, _JSON

    def usage_wanted(self, req: dict[str, Any] | None) -> bool:
        """Whether a stream of this request ends with its usage (else it is counted by its events)."""
        so = req.get("stream_options") if req is not None else None
        return isinstance(so, dict) and so.get("include_usage") is True

    def pin(self, pool: Pool, model: str, req: dict[str, Any] | None) -> EndpointState | RouterError | None:
        """The one replica that may answer (it stores what the request names), or the refusal; None
        when any replica may. May make the body's reference the engine's own (then ``req`` changed)."""
        return None

    def rewrite(self, data: bytes, tag: str) -> bytes:
        """A whole answer from the replica tagged ``tag``, as the client gets it."""
        return data

    def tagger(self, tag: str) -> StreamTagger | None:
        """What rewrites a stream from the replica tagged ``tag`` as it passes; None: sent as it came."""
        return None

    def refusal(self, err: RouterError) -> Response:
        """The router's own refusal in this family's error shape."""
        return err.response()

    def held_end(self, body: bytes, status: int) -> bytes:
        """The last event of a held stream begun before its answer was known (holding.py): the answer's
        body as one SSE event, then the end."""
        event = b"".join(b"data: " + line + b"\n" for line in body.splitlines()) + b"\n"
        return event + b"data: [DONE]\n\n" if status < 300 else event

    def held_error(self, err: RouterError) -> bytes:
        return err.body()


class Responses(Dialect):
    """The Responses API: a response is stored on the replica that made it; its streams always end with
    ``response.completed`` (usage in it), and are never continued (a stored response cannot be rebuilt)."""

    __slots__ = ()

    def usage_wanted(self, req: dict[str, Any] | None) -> bool:
        return True

    def pin(self, pool: Pool, model: str, req: dict[str, Any] | None) -> EndpointState | RouterError | None:
        prev = req.get("previous_response_id") if req is not None else None
        found = untag(prev) if isinstance(prev, str) else None
        if found is None:
            return None
        assert req is not None and isinstance(prev, str)
        ep = pool.by_tag.get(found[0])
        if ep is None:
            return gone(prev)
        if ep.model != model:
            return error_response(
                400,
                f"previous_response_id {prev!r} was made by model {ep.model!r}, not {model!r}",
                param="previous_response_id",
            )
        req["previous_response_id"] = found[1]
        return ep

    def rewrite(self, data: bytes, tag: str) -> bytes:
        return tag_ids(data, tag)

    def tagger(self, tag: str) -> StreamTagger | None:
        return StreamTagger(tag)


class Messages(Dialect):
    """Anthropic's Messages API: its own error shape (``{"type": "error", "error": {...}}``, its SDK and
    Claude Code read it), ``event: error`` and no ``[DONE]`` in a stream; its streams always end with
    ``message_delta`` (usage in it)."""

    __slots__ = ()

    def usage_wanted(self, req: dict[str, Any] | None) -> bool:
        return True

    def refusal(self, err: RouterError) -> Response:
        return err.response(anthropic=True)

    def held_end(self, body: bytes, status: int) -> bytes:
        event = b"".join(b"data: " + line + b"\n" for line in body.splitlines()) + b"\n"
        return b"event: error\n" + event if status >= 300 else event

    def held_error(self, err: RouterError) -> bytes:
        return err.body(anthropic=True)


class Audio(Dialect):
    """Transcriptions and translations: a multipart form, ``model`` and ``stream`` its fields; the file
    is never decoded."""

    __slots__ = ()

    def parse(self, body: bytes, request: Request) -> Parsed | RouterError:
        ctype = request.header(b"content-type")
        fields = form_fields(body, ctype)
        if isinstance(fields, str):
            return error_response(400, fields, param="model" if "model" in fields else None)
        assert ctype is not None
        stream = fields.get("stream", "").lower() == "true"
        return fields["model"], stream, None, ctype.encode("latin-1", "replace")


# The families (llmgw_common.apis.Api), one object each; routes.py names one per path.
CHAT = Dialect("chat", continuation="chat", prompted=True, salted=True)
CHAT_BATCH = Dialect("chat batch")
COMPLETIONS = Dialect("completions", continuation="text", prompted=True, salted=True)
RESPONSES = Responses("responses", salted=True)
MESSAGES = Messages("messages", salted=True)
OPENAI = Dialect("openai")
AUDIO = Audio("audio")
