"""Arize Phoenix as a real OTLP receiver for the tracing tests: ``phoenix serve`` from its own venv
(``make otel-deps`` installs it under ~/.cache/llmgw/phoenix), on free ports, its data in a temporary
folder; its REST API read back for the spans of one trace. Tests that need it skip without it."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.kit.ports import free_port

PHOENIX_VENV = Path(
    os.environ.get("LLMGW_PHOENIX_VENV", Path.home() / ".cache" / "llmgw" / "phoenix")
).expanduser()
PHOENIX_BIN = PHOENIX_VENV / "bin" / "phoenix"
START_TIMEOUT_S = 120.0  # its first start migrates its database: tens of seconds on a busy machine


@dataclass(frozen=True)
class Phoenix:
    url: str

    @property
    def traces_endpoint(self) -> str:
        """Where OTLP/HTTP spans go (what ``otlp_traces_endpoint`` is set to)."""
        return f"{self.url}/v1/traces"

    def spans(self, trace_id: int, project: str = "default") -> list[dict[str, Any]]:
        """Every span Phoenix holds of ``trace_id`` (its REST API pages through the project's spans)."""
        import json

        want = f"{trace_id:032x}"
        out: list[dict[str, Any]] = []
        cursor = None
        while True:
            q = f"{self.url}/v1/projects/{project}/spans?limit=1000" + (f"&cursor={cursor}" if cursor else "")
            try:
                with urllib.request.urlopen(q, timeout=10) as r:
                    page = json.loads(r.read())
            except urllib.error.HTTPError as e:
                if e.code == 404:  # the project appears with its first span
                    return out
                raise
            out += [s for s in page["data"] if s["context"]["trace_id"] == want]
            cursor = page.get("next_cursor")
            if not cursor:
                return out


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/healthz", timeout=2) as r:
            return bool(r.status == 200)
    except (urllib.error.URLError, OSError):
        return False


@pytest.fixture(scope="session")
def phoenix(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Phoenix]:
    if not PHOENIX_BIN.exists():
        pytest.skip(f"Arize Phoenix is not installed at {PHOENIX_VENV} (make otel-deps)")
    work = tmp_path_factory.mktemp("phoenix")
    port, grpc = free_port(), free_port()
    env = dict(
        os.environ,
        PHOENIX_WORKING_DIR=str(work),
        PHOENIX_HOST="127.0.0.1",
        PHOENIX_PORT=str(port),
        PHOENIX_GRPC_PORT=str(grpc),
        PHOENIX_TELEMETRY_ENABLED="false",
    )
    log = (work / "phoenix.log").open("wb")
    proc = subprocess.Popen(
        [str(PHOENIX_BIN), "serve"], env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
    )
    url = f"http://127.0.0.1:{port}"
    try:
        until = time.monotonic() + START_TIMEOUT_S
        while not _healthy(url):
            if proc.poll() is not None:
                raise RuntimeError(
                    f"phoenix exited ({proc.returncode}): {(work / 'phoenix.log').read_text()[-2000:]}"
                )
            if time.monotonic() > until:
                raise RuntimeError(f"phoenix did not answer /healthz within {START_TIMEOUT_S:g}s")
            time.sleep(0.5)
        yield Phoenix(url)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        log.close()
        shutil.rmtree(work, ignore_errors=True)
