"""The shipped ``deploy/nats/nats-{1,2,3}.conf`` include the generated authorization: a server whose
``auth.conf`` was never generated refuses to start, rather than serving the cluster to anyone.

Checked with the real nats-server of the environment: the shipped files as they are (``-t``: parse and
check the configuration), and one server actually started from its local derivation (loopback ports,
a temporary store), before and after ``llmgw setup --nats-auth`` wrote the file.
"""

from __future__ import annotations

import asyncio
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import nats
import nats.errors
import pytest
import yaml

from llmgw_runtime import bus
from llmgw_runtime.natsserver import find_nats_server
from llmgw_runtime.settings import BusSettings
from tests.kit.poll import eventually_sync
from tests.kit.ports import free_port
from tests.natscluster.natscluster_harness import DEPLOY, derive_config

SERVERS = ("nats-1.conf", "nats-2.conf", "nats-3.conf")


def setup_auth(directory: Path) -> Path:
    """``llmgw setup --nats-auth`` as the deploy docs say, into ``directory``; the creds folder."""
    creds = directory / "creds"
    argv = [sys.executable, "-m", "llmgw_cli", "setup", "--no-input"]
    argv += ["--nats-auth", str(directory / "auth.conf"), "--nodes", "n1", "--creds-dir", str(creds)]
    r = subprocess.run(
        argv,
        capture_output=True,
        text=True,
        stdin=subprocess.DEVNULL,
        timeout=60,
    )
    assert r.returncode == 0, r.stderr
    return creds


def check_config(conf: Path) -> subprocess.CompletedProcess[str]:
    # Run from elsewhere: the include is resolved next to the configuration file, not in the cwd.
    return subprocess.run(
        [find_nats_server(), "-t", "-c", str(conf)], capture_output=True, text=True, timeout=30, cwd="/"
    )


@pytest.mark.parametrize("name", SERVERS)
@pytest.mark.slow
def test_shipped_config_needs_the_generated_auth_file(tmp_path: Path, name: str) -> None:
    conf = tmp_path / name
    shutil.copy(DEPLOY / name, conf)
    r = check_config(conf)
    assert r.returncode != 0, r.stdout + r.stderr
    assert f"open {tmp_path / 'auth.conf'}: no such file or directory" in r.stdout + r.stderr
    setup_auth(tmp_path)
    r = check_config(conf)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "is valid" in r.stdout + r.stderr


def _local_config(directory: Path) -> Path:
    ports = [free_port() for _ in range(3)]
    text = derive_config(
        (DEPLOY / "nats-1.conf").read_text(),
        client_port=free_port(),
        monitor_port=free_port(),
        cluster_ports=ports,
        store=directory / "jetstream",
        auth=True,
    )
    conf = directory / "nats.conf"
    conf.write_text(text)
    return conf


def _nats_server(conf: Path, log: Path) -> subprocess.Popen[bytes]:
    with open(log, "wb") as out:  # the child keeps its own handle
        # The derived file leaves the store to -sd (as the harness's servers get it).
        argv = [find_nats_server(), "-c", str(conf), "-sd", str(conf.parent / "jetstream")]
        return subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)


def _client_port(conf: Path) -> int:
    for line in conf.read_text().splitlines():
        if line.startswith("listen: 127.0.0.1:"):
            return int(line.rsplit(":", 1)[1])
    raise AssertionError("no client listen line")


def _wait_listening(proc: subprocess.Popen[bytes], port: int, log: Path, timeout: float = 20.0) -> None:
    def listening() -> bool:
        assert proc.poll() is None, f"nats-server exited with {proc.returncode}:\n{log.read_text()}"
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return True
        except OSError:
            return False

    try:
        eventually_sync(listening, timeout=timeout, every=0.05, what=f"nats-server to listen on {port}")
    except AssertionError as e:
        if proc.poll() is not None:
            raise  # it exited: the message has its log already
        raise AssertionError(f"{e}\n{log.read_text()}") from None


@pytest.mark.slow
async def test_a_server_without_its_auth_file_refuses_to_start_and_with_it_refuses_strangers(
    tmp_path: Path,
) -> None:
    conf = _local_config(tmp_path)
    log = tmp_path / "nats.log"
    proc = _nats_server(conf, log)
    try:
        code = await asyncio.to_thread(proc.wait, 20)
    except subprocess.TimeoutExpired:
        code = None
    finally:
        if proc.poll() is None:
            proc.kill()
            await asyncio.to_thread(proc.wait)
    assert code is not None and code != 0, f"started without its auth file:\n{log.read_text()}"
    assert f"open {tmp_path / 'auth.conf'}: no such file or directory" in log.read_text()

    creds = await asyncio.to_thread(setup_auth, tmp_path)
    port = _client_port(conf)
    proc = _nats_server(conf, log)
    try:
        await asyncio.to_thread(_wait_listening, proc, port, log)
        url = f"nats://127.0.0.1:{port}"

        async def error_cb(_: Exception) -> None:
            pass  # the refusal is raised by connect() too

        # nats-py raises the server's -ERR as a plain nats.errors.Error: the message says which.
        with pytest.raises(nats.errors.Error, match="'Authorization Violation'"):
            await nats.connect(url, allow_reconnect=False, connect_timeout=5, error_cb=error_cb)
        # The same server lets a generated role in: the refusal above was the authorization.
        admin = yaml.safe_load((creds / "admin.yaml").read_text())
        s = BusSettings(
            nats_urls=[url],
            nats_user=admin["nats_user"],
            nats_password=admin["nats_password"],
            nats_inbox_prefix=admin["nats_inbox_prefix"],
        )
        nc = await bus.connect(s, "deploy-auth-test", wait=False)
        assert nc.is_connected
        await nc.close()
    finally:
        proc.terminate()
        await asyncio.to_thread(proc.wait, 10)
