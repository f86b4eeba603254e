"""Static mode's file: every bad input is refused, each problem named, all of them listed at once."""

from __future__ import annotations

from typing import Any

import pytest

from llmgw_router.static import StaticConfigError, parse_static

H = "a" * 64
H2 = "b" * 64


def _m(**kw: Any) -> dict[str, Any]:
    return {"name": "m", "endpoints": ["http://127.0.0.1:9001"], **kw}


def test_a_good_file_parses() -> None:
    cfg = parse_static(
        {
            "auth": True,
            "models": [
                _m(max_concurrency=4, endpoints=["http://a:1/", "https://b/x/"]),
                {"name": "down", "endpoints": []},
                {"name": "v", "engine": "vllm", "endpoints": ["http://c:2"]},
            ],
            "keys": [{"name": "dev", "hash": H.upper(), "models": ["m"]}, {"name": "ops", "hash": H2}],
        }
    )
    assert cfg.auth and cfg.catalog.names == ("m", "down", "v")
    assert [e.url for e in cfg.routing.endpoints["m"]] == ["http://a:1", "https://b/x"]
    assert cfg.routing.endpoints["down"] == ()
    assert cfg.catalog.get("m").max_concurrency == 4  # type: ignore[union-attr]
    assert cfg.catalog.get("m").engine == "sim"  # type: ignore[union-attr]
    assert [(k.name, k.hash, k.models) for k in cfg.keys] == [("dev", H, ("m",)), ("ops", H2, None)]
    assert len({k.id for k in cfg.keys}) == 2


@pytest.mark.parametrize(
    ("data", "keys_given", "auth"),
    [
        ({"models": []}, False, False),
        ({"models": [], "keys": None}, False, False),
        ({"keys": [{"name": "k", "hash": H}]}, True, True),
        ({"keys": [{"name": "k", "hash": H}], "auth": False}, True, False),
        ({"auth": True}, False, True),
        ("models: []\nauth: false\n", False, False),
        ("", False, False),
    ],
)
def test_auth_defaults_to_on_exactly_when_keys_are_listed(data: Any, keys_given: bool, auth: bool) -> None:
    cfg = parse_static(data)
    assert bool(cfg.keys) is keys_given and cfg.auth is auth


BAD: list[tuple[str, Any, str]] = [
    ("not a mapping", ["models"], "a static file is a mapping"),
    ("not YAML", "models: [\n", "not valid YAML"),
    ("unknown top-level field", {"models": [], "extra": 1}, "static file: extra: unknown field"),
    ("auth as a string", {"auth": "false"}, "static file: auth: Input should be a valid boolean"),
    ("auth as a number", {"auth": 1}, "static file: auth: Input should be a valid boolean"),
    ("models not a list", {"models": {"name": "m"}}, "static file: models: Input should be a valid list"),
    ("keys not a list", {"keys": "dev"}, "static file: keys: Input should be a valid list"),
    ("model without a name", {"models": [{"endpoints": []}]}, "models[0]: name: Field required"),
    ("model not a mapping", {"models": ["m"]}, "models[0]: Input should be a valid dictionary"),
    ("duplicate model", {"models": [_m(), _m()]}, "model 'm': duplicate name (also models[0])"),
    ("unknown engine", {"models": [_m(engine="nope")]}, "model 'm': unknown engine 'nope'"),
    ("unknown model field", {"models": [_m(colour=1)]}, "model 'm': colour: unknown field"),
    ("bad profile value", {"models": [_m(max_concurrency=0)]}, "model 'm': max_concurrency: Input should be"),
    ("endpoints not a list", {"models": [_m(endpoints="nope")]}, "'endpoints' must be a list"),
    ("endpoint not http", {"models": [_m(endpoints=["ftp://x"])]}, "'ftp://x' is not an http(s) URL"),
    ("endpoint without a host", {"models": [_m(endpoints=["http://"])]}, "'http://' is not an http(s) URL"),
    ("endpoint not a string", {"models": [_m(endpoints=[5])]}, "5 is not an http(s) URL"),
    (
        "endpoint twice",
        {"models": [_m(endpoints=["http://a:1", "http://a:1/"])]},
        "model 'm': endpoint 'http://a:1' is listed twice",
    ),
    (
        "model name not a token",
        {"models": [_m(name="a b")]},
        "model 'a b': model name 'a b' may contain only",
    ),
    # A trailing newline passed the old `$`-anchored rule: one name check for catalog and static file.
    ("model name with a newline", {"models": [_m(name="tiny2\n")]}, "model 'tiny2\\n': model name"),
    (
        "alias bomb",
        "a: &a [x, x, x, x, x, x, x, x, x, x]\n"
        + "".join(
            f"{c}: &{c} [*{p}, *{p}, *{p}, *{p}, *{p}, *{p}, *{p}, *{p}, *{p}, *{p}]\n"
            for p, c in zip("abcdefgh", "bcdefghi", strict=True)
        ),
        "once its aliases are expanded",
    ),
    ("key without a hash", {"keys": [{"name": "dev"}]}, "key 'dev': hash: Field required"),
    ("key hash too short", {"keys": [{"name": "dev", "hash": "x"}]}, "key 'dev': hash: "),
    ("key hash not hex", {"keys": [{"name": "dev", "hash": "z" * 64}]}, "key 'dev': hash: "),
    ("key without a name", {"keys": [{"hash": H}]}, "keys[0]: name: Field required"),
    ("unknown key field", {"keys": [{"name": "dev", "hash": H, "modles": []}]}, "key 'dev': modles: unknown"),
    (
        "duplicate key name",
        {"keys": [{"name": "dev", "hash": H}, {"name": "dev", "hash": H2}]},
        "key 'dev': duplicate name (also keys[0])",
    ),
    (
        "one hash for two keys",
        {"keys": [{"name": "a", "hash": H}, {"name": "b", "hash": H.upper()}]},
        "key 'b': the same hash as key 'a'",
    ),
    (
        "key for a model not in the file",
        {"models": [_m()], "keys": [{"name": "dev", "hash": H, "models": ["m", "tiny"]}]},
        "key 'dev': model 'tiny' is not in this file",
    ),
]


@pytest.mark.parametrize(("data", "problem"), [(d, p) for _, d, p in BAD], ids=[i for i, _, _ in BAD])
def test_each_bad_input_is_refused_naming_the_problem(data: Any, problem: str) -> None:
    with pytest.raises(StaticConfigError) as e:
        parse_static(data)
    assert problem in str(e.value), str(e.value)


def test_every_problem_is_listed_at_once() -> None:
    with pytest.raises(StaticConfigError) as e:
        parse_static(
            {
                "auth": "yes",
                "extra": 1,
                "models": [_m(), _m(engine="nope"), {"name": "x", "endpoints": ["ftp://x"]}, {"nope": 1}],
                "keys": [{"name": "dev", "hash": "x"}, {"name": "ok", "hash": H, "models": ["gone"]}],
            }
        )
    problems = e.value.problems
    for bit in (
        "static file: auth:",
        "static file: extra: unknown field",
        "model 'm': unknown engine 'nope'",
        "model 'm': duplicate name",
        "model 'x': endpoints:",
        "models[3]: name: Field required",
        "key 'dev': hash:",
        "key 'ok': model 'gone' is not in this file",
    ):
        assert any(bit in p for p in problems), (bit, problems)
    assert str(e.value).startswith("invalid static file:\n  - ")
