"""The console's plumbing through the ASGI app: refresh, a 503 page when the source fails, debug stats,
the packaged stylesheet and the navigation."""

from __future__ import annotations

import re

import httpx
import pytest

from llmgw_controlplane.admin import CONSOLE_DIR, PAGES
from tests.console.console_fleet import FixedSource
from tests.console.console_pages import PATHS, client, get


async def test_refresh(c: httpx.AsyncClient) -> None:
    assert '<meta http-equiv="refresh" content="10">' in await get(c, "/")
    paused = await get(c, "/nodes?refresh=0")
    assert 'http-equiv="refresh"' not in paused and "paused" in paused
    assert '<meta http-equiv="refresh" content="60">' in await get(c, "/models?refresh=60")
    assert (await c.get("/?refresh=-1")).status_code == 422
    assert (await c.get("/?refresh=x")).status_code == 422


async def test_source_unavailable_gives_503_page() -> None:
    async with client(
        FixedSource(fail="status: the control plane could not read its state from NATS (timeout)")
    ) as c:
        for path in [*PATHS, "/debug/stats"]:
            r = await c.get(path)
            assert r.status_code == 503, path
            assert "could not read its state from NATS (timeout)" in r.text
            assert r.headers["content-security-policy"]
        stats = await c.get("/style.css")
        assert stats.status_code == 200


async def test_debug_stats(c: httpx.AsyncClient) -> None:
    await get(c, "/")
    await get(c, "/")
    await get(c, "/nodes")
    r = await c.get("/debug/stats")
    assert r.status_code == 200 and r.headers["content-type"] == "application/json"
    d = r.json()
    assert d["passes"] == 42 and d["last_pass_ms"] == 1.5 and d["nodes"] == 8
    assert d["console"]["requests"] == {"overview": 2, "nodes": 1}
    assert d["console"]["render_max_ms"]["overview"] > 0


async def test_stylesheet_served_from_the_package(c: httpx.AsyncClient) -> None:
    r = await c.get("/style.css")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/css")
    assert r.content == (CONSOLE_DIR / "style.css").read_bytes()
    assert CONSOLE_DIR.parent.name == "llmgw_controlplane"
    for _, key, _ in PAGES:
        assert (CONSOLE_DIR / f"{key}.html").is_file()


@pytest.mark.parametrize("path", PATHS)
async def test_every_page_has_the_nav_and_marks_itself(c: httpx.AsyncClient, path: str) -> None:
    page = await get(c, path)
    for href, _, label in PAGES:
        assert f'href="{href}"' in page and label in page
    assert page.count('aria-current="page"') == 1
    assert re.search(rf'<a href="{re.escape(path)}" class="on"', page)
