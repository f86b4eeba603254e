"""What the console will not do, through the ASGI app: run script, take writes, serve a non-loopback
host name, expose docs, or let forwarded headers change a page."""

from __future__ import annotations

import html
import re

import httpx
import pytest
from starlette.routing import Route

from llmgw_controlplane.admin import build_admin_app
from tests.console.console_fleet import HOSTILE, FixedSource
from tests.console.console_pages import PATHS, client, get, text


@pytest.mark.parametrize("path", PATHS)
async def test_everything_escaped_and_no_script(c: httpx.AsyncClient, path: str) -> None:
    page = await get(c, path)
    assert "<script" not in page.lower()
    assert "<img" not in page.lower()
    assert "onerror=alert" not in page.replace("&lt;img src=x onerror=alert(1)&gt;", "")


async def test_hostile_strings_shown_as_text(c: httpx.AsyncClient) -> None:
    nodes = await get(c, "/nodes")
    assert html.escape(HOSTILE, quote=True) in nodes or "&lt;script&gt;" in nodes
    assert HOSTILE in text(nodes)  # shown, as text
    replicas = await get(c, "/replicas")
    assert "&lt;img src=x onerror=alert(1)&gt; &amp; done" in replicas
    assert HOSTILE in text(await get(c, "/usage"))


def test_every_route_is_get_only() -> None:
    app = build_admin_app(FixedSource())
    routes = [r for r in app.routes if isinstance(r, Route)]  # every route with methods (not a mount)
    assert {r.path for r in routes} == {*PATHS, "/style.css", "/debug/stats"}
    for r in routes:
        assert r.methods == {"GET"}, (r.path, r.methods)


@pytest.mark.parametrize("path", [*PATHS, "/style.css", "/debug/stats"])
@pytest.mark.parametrize("method", ["POST", "PUT", "PATCH", "DELETE"])
@pytest.mark.slow
async def test_writes_get_405(c: httpx.AsyncClient, path: str, method: str) -> None:
    r = await c.request(method, path, content=b"x")
    assert r.status_code == 405


async def test_no_docs_or_openapi(c: httpx.AsyncClient) -> None:
    for path in ("/docs", "/redoc", "/openapi.json"):
        assert (await c.get(path)).status_code == 404


async def test_security_headers(c: httpx.AsyncClient) -> None:
    r = await c.get("/")
    csp = r.headers["content-security-policy"]
    assert "default-src 'none'" in csp and "style-src 'self'" in csp and "frame-ancestors 'none'" in csp
    assert "script-src" not in csp  # no script of any kind is allowed by default-src 'none'
    assert r.headers["cache-control"] == "no-store"
    assert r.headers["x-content-type-options"] == "nosniff"


@pytest.mark.parametrize("host", ["evil.example", "evil.example:8081", "10.0.0.5:8081", "0.0.0.0:8081", ""])
async def test_non_loopback_host_refused(c: httpx.AsyncClient, host: str) -> None:
    r = await c.get("/", headers={"host": host})
    assert r.status_code == 400
    assert "loopback host name" in r.text
    assert "gpu-a01" not in r.text


@pytest.mark.parametrize("host", ["127.0.0.1", "localhost:8081", "[::1]:8081", "127.0.0.2:1"])
async def test_loopback_hosts_served(c: httpx.AsyncClient, host: str) -> None:
    r = await c.get("/nodes", headers={"host": host})
    assert r.status_code == 200 and "gpu-a01" in r.text


async def test_public_listener_serves_any_host() -> None:
    async with client(FixedSource(), loopback_only=False) as c:
        r = await c.get("/", headers={"host": "console.example:8081"})
    assert r.status_code == 200


async def test_forwarded_headers_change_nothing(c: httpx.AsyncClient) -> None:
    plain = await c.get("/")
    fwd = await c.get(
        "/",
        headers={
            "x-forwarded-host": "evil.example",
            "x-forwarded-for": "203.0.113.9",
            "x-forwarded-proto": "https",
            "forwarded": "host=evil.example",
        },
    )
    assert fwd.status_code == 200
    assert fwd.text == plain.text
    assert "evil.example" not in fwd.text
    # Every link stays a path on this listener.
    assert not re.search(r'(href|src)="(?!/|\?)', fwd.text)
