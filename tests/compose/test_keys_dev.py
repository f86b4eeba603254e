"""``llmgw keys dev``, what the compose cluster's ``devkey`` service runs: the development key minted as
``llmgw up`` mints it, reused on the next ``up`` while its record is valid, and NATS waited for.

Fast (a real nats-server, the real CLI as a process): part of ``make test``, unlike ``run.py``.
"""

from __future__ import annotations

import socket
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from llmgw_cli.devkey import DEV_KEY_NAME
from llmgw_runtime.natsserver import NatsServer

pytestmark = pytest.mark.e2e  # real processes: the CLI, five times


def keys(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "llmgw_cli", "keys", *args], capture_output=True, text=True, timeout=60
    )


def test_the_dev_key_is_minted_once_reused_and_minted_again_once_revoked(
    nats_server: NatsServer, prefix: str, tmp_path: Path
) -> None:
    key_file = tmp_path / "keys" / "dev-key"
    key_file.parent.mkdir()
    bus = ["--nats", nats_server.url, "--prefix", prefix]
    first = keys("dev", "--key-file", str(key_file), *bus)
    assert first.returncode == 0, first.stderr
    key = first.stdout.strip()
    assert key.startswith("llmgw-") and "minted" in first.stderr
    assert key_file.read_text().strip() == key
    assert stat.S_IMODE(key_file.stat().st_mode) == 0o600  # the notifier's probe key: its user only

    again = keys("dev", "--key-file", str(key_file), *bus)
    assert again.returncode == 0 and again.stdout.strip() == key and "reused" in again.stderr

    revoked = keys("revoke", DEV_KEY_NAME, *bus)
    assert revoked.returncode == 0, revoked.stderr
    new = keys("dev", "--key-file", str(key_file), *bus)
    assert new.returncode == 0 and "minted" in new.stderr
    assert new.stdout.strip() != key and key_file.read_text().strip() == new.stdout.strip()


def test_the_dev_key_waits_for_nats_then_gives_up(tmp_path: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = s.getsockname()[1]
    t0 = time.monotonic()
    r = keys(
        "dev", "--key-file", str(tmp_path / "dev-key"), "--nats", f"nats://127.0.0.1:{dead}", "--wait", "2"
    )
    took = time.monotonic() - t0
    assert r.returncode == 1 and "cannot reach NATS" in r.stderr
    assert took >= 2, f"gave up after {took:.1f} s, before --wait"
    assert not (tmp_path / "dev-key").exists()
