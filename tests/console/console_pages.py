"""Reading the console's pages in tests: a client over the ASGI app (fixed ctl replies, a held clock),
a page's visible text and a table's rows."""

from __future__ import annotations

import html
import re

import httpx

from llmgw_controlplane.admin import PAGES, build_admin_app
from tests.console.console_fleet import NOW, FixedSource

PATHS = [p for p, _, _ in PAGES]


def client(source: FixedSource, *, loopback_only: bool = True) -> httpx.AsyncClient:
    app = build_admin_app(source, clock=lambda: NOW, loopback_only=loopback_only)
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://127.0.0.1:8081")


def text(page: str) -> str:
    """The visible text of a page, tags stripped and entities decoded, whitespace collapsed."""
    page = re.sub(r"<svg.*?</svg>", " ", page, flags=re.S)  # bars: their tooltips are not table text
    page = re.sub(r"</?(td|th|tr|div|p|pre|br|caption|table|h2|li)\b[^>]*>", " ", page)
    return " ".join(html.unescape(re.sub(r"<[^>]+>", "", page)).split())


def rows(page: str, table_id: str) -> list[str]:
    m = re.search(rf'<table[^>]*id="{table_id}".*?</table>', page, re.S)
    assert m, f"no table {table_id}"
    return [text(r) for r in re.findall(r"<tr[^>]*>(.*?)</tr>", m.group(0), re.S)]


async def get(c: httpx.AsyncClient, path: str) -> str:
    r = await c.get(path)
    assert r.status_code == 200, (path, r.status_code, r.text[:500])
    assert r.headers["content-type"].startswith("text/html")
    return r.text
