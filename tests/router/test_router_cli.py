"""``llmgw router`` as a real process: static mode, openai client, SIGTERM; bad files refused."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from pathlib import Path

import aiohttp
import openai
import pytest
import yaml
from typer.testing import CliRunner

from llmgw_runtime.apikeys import generate_key, hash_key
from tests.router.router_helpers import EngineFactory, PortFactory, wait_serving


@pytest.mark.slow
async def test_router_process_in_static_mode(
    engines: EngineFactory, tmp_path: Path, port: PortFactory
) -> None:
    eng = await engines("m1")
    key = generate_key()
    static = tmp_path / "static.yaml"
    static.write_text(
        yaml.safe_dump(
            {
                "keys": [{"name": "k", "hash": hash_key(key)}],
                "models": [{"name": "m1", "endpoints": [eng.url]}],
            }
        )
    )
    p, admin = port(), port()
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "llmgw_cli",
        "router",
        "--static",
        str(static),
        "--port",
        str(p),
        "--admin-port",
        str(admin),
        "--router-id",
        "cli",
        start_new_session=True,
        stderr=asyncio.subprocess.DEVNULL,
    )
    try:
        await wait_serving(f"http://127.0.0.1:{p}/health", proc, timeout=20.0)
        client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{p}/v1", api_key=key, max_retries=0)
        reply = await client.chat.completions.create(model="m1", messages=[{"role": "user", "content": "hi"}])
        assert reply.choices[0].message.content
        await client.close()
        async with aiohttp.ClientSession() as s, s.get(f"http://127.0.0.1:{admin}/metrics") as r:
            assert 'llmgw_router_requests_total{model="m1",status="200"} 1.0' in await r.text()
        os.killpg(proc.pid, signal.SIGTERM)
        assert await asyncio.wait_for(proc.wait(), 15) == 0
    finally:
        if proc.returncode is None:
            os.killpg(proc.pid, signal.SIGKILL)
            await proc.wait()


def test_bad_static_file_is_refused_with_every_problem(tmp_path: Path) -> None:
    from llmgw_cli.main import app

    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump({"models": [{"name": "m", "endpoints": "nope"}], "extra": 1}))
    res = CliRunner().invoke(app, ["router", "--static", str(bad)])
    assert res.exit_code == 2
    assert "'endpoints' must be a list" in res.stderr and "static file: extra: unknown field" in res.stderr
    res = CliRunner().invoke(app, ["router", "--static", str(tmp_path / "missing.yaml")])
    assert res.exit_code == 2 and "cannot read" in res.stderr
