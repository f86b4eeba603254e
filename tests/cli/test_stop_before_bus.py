"""A service asked to stop while it still waits for NATS stops (it used to retry the connection for as
long as it liked: SIGTERM was heard but nothing watched it until the first connection succeeded)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.kit.poll import eventually_sync


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
@pytest.mark.slow
def test_sigterm_while_waiting_for_nats_stops_the_service(argv: list[str], tmp_path: Path) -> None:
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
        seen = b""
        assert proc.stderr is not None
        stderr = proc.stderr
        os.set_blocking(stderr.fileno(), False)

        def said_refused_or_exited() -> bool:
            nonlocal seen
            seen += stderr.read(4096) or b""
            return b"refused" in seen.lower() or proc.poll() is not None

        try:
            eventually_sync(
                said_refused_or_exited,
                timeout=60,
                every=0.1,
                what="the service to say NATS refused it (or to exit)",
            )
        except AssertionError as e:
            raise AssertionError(f"{e}\n{seen.decode()[-2000:]}") from None
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
