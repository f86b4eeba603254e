"""The console in a real headless Chromium (Debian's package, driven by Playwright): every page renders
under its own CSP with the stylesheet applied, shows the fleet, and a screenshot of each is kept in
``test-artifacts/console-*.png``. Skipped, with the install command, when Chromium or Playwright is absent."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest

from llmgw_controlplane.admin import PAGES, AdminServer, build_admin_app
from tests.console.console_fleet import NODES, NOW, UNHEALTHY_REASON, FixedSource
from tests.console.console_live import LIVE_UNHEALTHY, LiveConsole
from tests.kit.poll import eventually

log = logging.getLogger("test.console")
VIEWPORT = {"width": 1440, "height": 900}


async def _open(browser: Any, url: str) -> tuple[Any, list[str]]:
    """A page at ``url`` and the list its console errors (CSP violations included) are collected into."""
    ctx = await browser.new_context(viewport=VIEWPORT, color_scheme="light")
    page = await ctx.new_page()
    errors: list[str] = []
    page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    page.on("pageerror", lambda e: errors.append(str(e)))
    resp = await page.goto(url, wait_until="load")
    assert resp is not None and resp.status == 200, (url, resp and resp.status)
    return page, errors


@pytest.mark.slow
async def test_every_page_in_chromium_over_fixed_fleet(browser: Any, artifacts_dir: Path) -> None:
    app = build_admin_app(FixedSource(), clock=lambda: NOW)
    server = AdminServer(app, "127.0.0.1", 0, False, log)
    port = await server.start()
    try:
        for path, key, label in PAGES:
            page, errors = await _open(browser, f"http://127.0.0.1:{port}{path}")
            assert await page.title() == f"{label} · llmgw"
            # The stylesheet loaded under the page's CSP: the header is dark, not the default white.
            bg = await page.eval_on_selector("header", "e => getComputedStyle(e).backgroundColor")
            assert bg == "rgb(29, 34, 41)", bg
            body = await page.inner_text("body")
            if key == "overview":
                banner = page.locator("#webhook-warning")
                assert await banner.is_visible()
                assert "llmgw setup --webhook URL" in await banner.inner_text()
                for cls in ("H100-80GB", "A100-40GB"):
                    assert cls in body
                # The unhealthy segment of the H100 bar is drawn, and is neither the used nor the free one.
                seg = page.locator("#capacity tr:has-text('H100-80GB') svg rect.unhealthy")
                box = await seg.bounding_box()
                assert box is not None and box["width"] > 0
            if key == "nodes":
                for n in NODES:
                    assert n.name in body
                assert UNHEALTHY_REASON in body
                assert "4xA100-40GB" in body
            if key == "replicas":
                assert await page.locator("pre.log").is_visible()
            await page.screenshot(path=str(artifacts_dir / f"console-{key}.png"), full_page=True)
            assert errors == [], errors
            await page.context.close()
    finally:
        await server.close()
    for _, key, _ in PAGES:
        assert (artifacts_dir / f"console-{key}.png").stat().st_size > 5000


@pytest.mark.slow
async def test_live_control_plane_in_chromium(
    browser: Any, live_console: LiveConsole, artifacts_dir: Path
) -> None:
    live = live_console

    async def settled() -> bool:
        s = await live.ctl.status()
        return s.nodes_by_state.get("ready") == 4 and [u.model for u in s.unplaceable] == ["giant"]

    await eventually(settled, timeout=15, what="all four nodes ready and giant known unplaceable")
    page, errors = await _open(browser, f"{live.url}/nodes")
    body = await page.inner_text("body")
    for node in ("h100-01", "h100-02", "a100-01", "cpu-01"):
        assert node in body
    assert f"GPU 7: {LIVE_UNHEALTHY}" in body
    await page.screenshot(path=str(artifacts_dir / "console-live-nodes.png"), full_page=True)
    await page.goto(f"{live.url}/", wait_until="load")
    assert await page.locator("#webhook-warning").is_visible()
    assert "giant" in await page.inner_text("#unplaceable")
    await page.screenshot(path=str(artifacts_dir / "console-live-overview.png"), full_page=True)
    assert errors == [], errors
    await page.context.close()
