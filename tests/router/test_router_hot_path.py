"""What the proxied request's hot path remembers or skips, shown to give the answers it gave before.

The key table remembers presented keys with their record (no hash per request): a change to the
table must reach the very next check. A request's headers are read from the parser's raw list
(no header dict per request): the lookups must answer as the dict did.
"""

from __future__ import annotations

from typing import Any

import pytest

from llmgw_common.messages import ApiKeyRecord
from llmgw_router.http.request import Request
from llmgw_router.tenancy import keys as keys_mod
from llmgw_router.tenancy.auth import bearer_key, request_key
from llmgw_router.tenancy.keys import KeyTable
from llmgw_runtime.apikeys import hash_key


def _rec(key: str, **kw: Any) -> ApiKeyRecord:
    return ApiKeyRecord(id=kw.pop("id", "k1"), name="n", hash=hash_key(key), created=0.0, **kw)


def test_a_key_revoked_after_use_is_refused_on_the_next_check() -> None:
    t = KeyTable([_rec("key-a")])
    assert t.check("key-a", 0.0).record is not None  # remembered now
    t.put(_rec("key-a", revoked=True))
    assert t.check("key-a", 0.0).problem == "API key 'n' was revoked"


def test_a_key_removed_after_use_is_refused_on_the_next_check() -> None:
    t = KeyTable([_rec("key-a")])
    assert t.check("key-a", 0.0).record is not None
    t.remove("k1")
    assert t.check("key-a", 0.0).problem == "invalid API key"


def test_a_key_replaced_after_use_is_refused_and_its_successor_accepted() -> None:
    t = KeyTable([_rec("key-a")])
    assert t.check("key-a", 0.0).record is not None
    t.put(_rec("key-b"))  # same id, new key: the old one is gone
    assert t.check("key-a", 0.0).problem == "invalid API key"
    assert t.check("key-b", 0.0).record is not None


def test_a_remembered_key_still_expires() -> None:
    t = KeyTable([_rec("key-a", expires=10.0)])
    assert t.check("key-a", 9.0).record is not None
    assert t.check("key-a", 10.0).problem == "API key 'n' has expired"


def test_the_memory_of_keys_is_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(keys_mod, "MEMO_SIZE", 3)
    recs = [_rec(f"key-{i}", id=f"k{i}") for i in range(10)]
    t = KeyTable(recs)
    for i in range(10):
        assert t.check(f"key-{i}", 0.0).record is recs[i]
        assert len(t._memo) <= 3
    for i in range(10):  # asked again, the answers are the same whether remembered or not
        assert t.check(f"key-{i}", 0.0).record is recs[i]
    assert t.check("key-x", 0.0).problem == "invalid API key" and "key-x" not in t._memo


def _request(raw: list[tuple[bytes, bytes]]) -> Request:
    return Request(None, "POST", "/v1/chat/completions", "", raw, "1.1", True)  # type: ignore[arg-type]


RAW_CASES = [
    [],
    [(b"Host", b"h"), (b"Authorization", b"Bearer abc"), (b"Content-Length", b"12")],
    [(b"authorization", b"bearer  abc "), (b"AUTHORIZATION", b"Bearer other")],
    [(b"Authorization", b"Basic abc"), (b"x-api-key", b"k")],
    [(b"Authorization", b""), (b"X-Api-Key", b"k2"), (b"api-key", b"k3")],
    [(b"api-key", b"k3")],
    [(b"Authorization", b"Bearer \xff\xfe")],
    [(b"Content-Length", b"-1")],
    [(b"Content-Length", b"7"), (b"content-length", b"9"), (b"Expect", b"100-Continue")],
    [(b"expect", b"100-continue"), (b"EXPECT", b"nope"), (b"Content-Lengtx", b"3"), (b"Authorizatiom", b"x")],
    [(b"Expect", b"\xff"), (b"Content-Length", b"")],
]


@pytest.mark.parametrize("raw", RAW_CASES)
def test_header_lookups_answer_as_the_header_dict(raw: list[tuple[bytes, bytes]]) -> None:
    req = _request(raw)
    headers = req.headers  # the CIMultiDict, built on demand
    for name in ("Authorization", "Content-Length", "Expect", "x-api-key", "api-key", "Host", "Nope"):
        assert _request(raw).header(name.lower().encode()) == headers.get(name)
    assert request_key(_request(raw)) == bearer_key(headers)
    assert req.authorization == headers.get("Authorization")
    cl = headers.get("Content-Length")
    assert req.content_length == (int(cl) if cl is not None and cl.isdigit() else None)
    assert req._expect_continue == (headers.get("Expect", "").lower() == "100-continue")


ENGINE_HEADERS = [
    [],
    [(b"Content-Type", b"application/json"), (b"Content-Length", b"12"), (b"Date", b"x"), (b"X-Req", b"1")],
    [(b"server", b"s"), (b"CONNECTION", b"keep-alive"), (b"x-a", b"1"), (b"X-A", b"2")],
    [(b"X-Evil", b"a\r\nSet-Cookie: b"), (b"content-type", b"text/plain\n"), (b"X-Latin", b"caf\xe9")],
    [(b"Transfer-Encoding", b"chunked"), (b"Trailer", b"t"), (b"TE", b"x"), (b"Upgrade", b"h2c")],
]


def _as_before(pairs: list[tuple[bytes, bytes]]) -> tuple[bytes, bool]:
    """The head lines as the proxy made them before relay_lines: a header dict, then each line built."""
    from multidict import CIMultiDict

    from llmgw_router.proxy import _DROP

    h: CIMultiDict[str] = CIMultiDict()
    for k, v in pairs:
        name = k.decode("latin-1")
        if name.lower() not in _DROP:
            h.add(name, v.decode("latin-1"))
    lines = b"".join(
        f"{k}: {v}\r\n".encode("latin-1", "replace") for k, v in h.items() if "\n" not in v and "\r" not in v
    )
    return lines, "Content-Type" in h


@pytest.mark.parametrize("pairs", ENGINE_HEADERS)
def test_relayed_header_lines_are_those_the_header_dict_gave(pairs: list[tuple[bytes, bytes]]) -> None:
    from llmgw_router.http.response import RelayedResponse, relay_lines
    from llmgw_router.proxy import _DROP_RAW

    lines, ctype, _ = relay_lines(pairs, _DROP_RAW)
    has_type = ctype is not None
    assert (lines, has_type) == _as_before(pairs)
    resp = RelayedResponse(200, b"{}", lines, has_type)
    assert ("Content-Type" in resp.headers) == (not has_type)
    assert not RelayedResponse(200, b"", lines, has_type).headers


class _Conn:
    """The client connection as an answer's head asks of it."""

    lost = False
    trust_forwarded = False
    date_header = b"Date: Thu, 03 Dec 2026 20:00:00 GMT\r\n"

    def __init__(self, close: bool = False, gone: bool = False) -> None:
        self.close, self._gone = close, gone

    def write_continue(self) -> None: ...

    def gone(self) -> bool:
        return self._gone

    def must_close(self, req: Request) -> bool:
        return self.close or not req.keep_alive

    async def send(self, data: bytes) -> None: ...


@pytest.mark.parametrize("status", [200, 201, 204, 304, 400, 404, 500, 599])
@pytest.mark.parametrize("body", [b"", b'{"id": 1}'])
@pytest.mark.parametrize("has_type", [True, False])
@pytest.mark.parametrize(
    ("method", "version", "keep_alive", "close"),
    [("POST", "1.1", True, False), ("POST", "1.1", False, False), ("POST", "1.1", True, True),
     ("POST", "1.0", True, False), ("HEAD", "1.1", True, False)],
)  # fmt: skip
def test_a_relayed_answer_is_the_bytes_the_generic_answer_made(
    status: int, body: bytes, has_type: bool, method: str, version: str, keep_alive: bool, close: bool
) -> None:
    """The relayed answer's own head (no pass over its header dict) against Response.whole's."""
    from llmgw_router.http.response import RelayedResponse, Response

    lines = b"Content-Type: application/json\r\nX-Req: 1\r\n" if has_type else b"X-Req: 1\r\n"
    req = Request(_Conn(close), method, "/v1/x", "", [(b"Host", b"h")], version, keep_alive)  # type: ignore[arg-type]
    fast, generic = (
        RelayedResponse(status, body, lines, has_type),
        RelayedResponse(status, body, lines, has_type),
    )
    got, want = fast.whole(req), Response.whole(generic, req)
    assert got == want and fast.will_close == generic.will_close
    assert got.startswith(b"HTTP/1.1 %d " % status)
    with pytest.raises(ConnectionResetError):
        RelayedResponse(status, body, lines, has_type).whole(
            Request(_Conn(gone=True), method, "/", "", [(b"Host", b"h")], version, keep_alive)  # type: ignore[arg-type]
        )


ANSWER_HEADERS = [
    [],
    [(b"Content-Type", b"application/json"), (b"Content-Length", b"12")],
    [(b"content-length", b"7"), (b"CONTENT-LENGTH", b"9"), (b"content-type", b"a"), (b"Content-Type", b"b")],
    [(b"Content-Length", b"-3"), (b"Content-Typf", b"x"), (b"Content-Lengtx", b"4")],
    [(b"Content-Type", b""), (b"Content-Length", b"")],
    [(b"Transfer-Encoding", b"chunked"), (b"Content-Type", b"text/event-stream")],
]


@pytest.mark.parametrize("pairs", ANSWER_HEADERS)
def test_an_answers_framing_from_the_relay_pass_is_what_the_two_lookups_gave(
    pairs: list[tuple[bytes, bytes]],
) -> None:
    from llmgw_router.http.response import relay_lines
    from llmgw_router.proxy import _DROP_RAW
    from llmgw_router.upstream.client import UpstreamClient, UpstreamResponse
    from llmgw_router.upstream.connection import UpstreamConnection

    conn = UpstreamConnection(None)  # type: ignore[arg-type]  # never reads: only its head is looked at
    conn.headers = pairs
    up = UpstreamResponse(UpstreamClient(1.0, 1.0), ("h", 1, False), conn, 1.0, 1.0)
    _, ctype, clen = relay_lines(pairs, _DROP_RAW)
    assert ctype == up.header(b"content-type")
    assert (int(clen) if clen is not None and clen.isdigit() else None) == up.content_length


BODIES = [
    b'{"model": "m"}',
    b'{"model": "m", "x": NaN, "y": 1e999, "z": "\\ud800"}',
    b"{",
    b'{"model": "m"} x',
    b'{"model": "caf\xe9"}',
    b'{"model": "m", "s": "\xed\xa0\x80"}',
    b"{\x00\x00\x00",
    b"{\x00",
    b"{\x00}",
    b"\xef\xbb\xbf{}",
    b'  {"model": "m"}',
    b"[]",
    b"",
    b'{"model": 3}',
]


def _parse_as_before(body: bytes) -> object:
    import json

    try:
        obj = json.loads(body)
    except (ValueError, UnicodeDecodeError) as e:
        return f"the request body is not valid JSON: {e}"
    if not isinstance(obj, dict):
        return "the request body must be a JSON object"
    model = obj.get("model")
    if not isinstance(model, str) or not model:
        return "you must provide a model parameter"
    return obj


@pytest.mark.parametrize("body", BODIES)
def test_a_body_parses_as_json_loads_parses_it(body: bytes) -> None:
    from llmgw_router.dialects.dialect import parse_request

    got, expected = parse_request(body), _parse_as_before(body)
    assert repr(got) == repr(expected)  # repr: NaN is not equal to itself
