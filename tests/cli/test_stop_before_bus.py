"""A service asked to stop while it still waits for NATS stops (it used to retry the connection for as
long as it liked: SIGTERM was heard but nothing watched it until the first connection succeeded)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import pytest


def _closed_port() -> int:
    # A port nothing listens on: bound, then released, so connecting is refused at once.
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.parametrize(
    "argv",
    [
        ["controlplane", "--admin-port", "0"],
        ["router", "--port", "0", "--admin-port", "0"],
        ["notifier"],
        ["agent", "--node", "n1", "--sim-gpus", "1xL4-24GB"],
    ],
    ids=["controlplane", "router", "notifier", "agent"],
)
def test_sigterm_while_waiting_for_nats_stops_the_service(argv: list[str], tmp_path) -> None:
    url = f"nats://127.0.0.1:{_closed_port()}"
    env = {**os.environ, "LLMGW_NATS_URLS": url}
    proc = subprocess.Popen(
        [sys.executable, "-m", "llmgw_cli", *argv, "--nats", url],
        env=env,
        cwd=tmp_path,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )
    try:
        # Wait until it is retrying: it has said so at least once.
        deadline = time.monotonic() + 60
        seen = b""
        assert proc.stderr is not None
        os.set_blocking(proc.stderr.fileno(), False)
        while b"refused" not in seen.lower() and time.monotonic() < deadline:
            chunk = proc.stderr.read(4096)
            if chunk:
                seen += chunk
            elif proc.poll() is not None:
                break
            else:
                time.sleep(0.1)
        assert proc.poll() is None, f"exited before the test could stop it: {seen.decode()[-2000:]}"
        assert b"refused" in seen.lower(), seen.decode()[-2000:]
        proc.send_signal(signal.SIGTERM)
        try:
            code = proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            pytest.fail("still running 15 s after SIGTERM while waiting for NATS")
        assert code == 0, seen.decode()[-2000:]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
