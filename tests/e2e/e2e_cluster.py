"""The shared `llmgw up` of the e2e tests: starting, stopping and talking to it."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from tests.kit.poll import eventually_sync

REPO = Path(__file__).resolve().parents[2]
START_TIMEOUT_S = 150.0


@dataclass
class Cluster:
    proc: subprocess.Popen[bytes]
    data_dir: Path
    out_path: Path
    state: dict[str, Any]
    started_s: float
    # Engine and other descendant pids seen while it ran (filled by tests that need them).
    seen: set[int] = field(default_factory=set)

    @property
    def base_url(self) -> str:
        return str(self.state["base_url"])

    @property
    def router_url(self) -> str:
        return str(self.state["router_url"])

    @property
    def key(self) -> str:
        return str(self.state["key"])

    @property
    def nats_url(self) -> str:
        return str(self.state["nats_url"])

    @property
    def prefix(self) -> str:
        return str(self.state["prefix"])

    @property
    def logs_dir(self) -> Path:
        return Path(self.state["logs_dir"])

    def output(self) -> str:
        return self.out_path.read_text(errors="replace")

    def diagnostics(self) -> str:
        """`up`'s output and the tail of every log, for an assertion message."""
        parts = [f"--- llmgw up (rc={self.proc.poll()}):\n{self.output()[-4000:]}"]
        logs = self.data_dir / "logs"
        for f in sorted(logs.glob("*.log")) if logs.exists() else []:
            parts.append(f"--- {f.name}:\n" + "\n".join(f.read_text(errors="replace").splitlines()[-25:]))
        return "\n".join(parts)


@contextlib.contextmanager
def shown_on_failure(extra: Callable[[], str]) -> Iterator[None]:
    """A wait (or check) that fails inside says ``extra()`` too: the cluster's output and logs, the
    last answer; taken when it fails, not before the wait."""
    try:
        yield
    except AssertionError as e:
        raise AssertionError(f"{e}\n{extra()}") from None


def _read_state(path: Path) -> dict[str, Any] | None:
    try:
        data: dict[str, Any] = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data


def start_up(data_dir: Path, *extra: str, timeout: float = START_TIMEOUT_S) -> Cluster:
    """Run `llmgw up` in ``data_dir`` on free ports and wait until it says it serves."""
    data_dir.mkdir(parents=True, exist_ok=True)
    out_path = data_dir.parent / f"{data_dir.name}-up.out"
    env = {k: v for k, v in os.environ.items() if not k.startswith("LLMGW_")}
    argv = [
        sys.executable, "-m", "llmgw_cli", "up",
        "--data-dir", str(data_dir),
        "--fleet", str(REPO / "examples" / "fleet.yaml"),
        "--catalog", str(REPO / "examples" / "catalog.yaml"),
        "--port", "0", "--admin-port", "0", "--nats-port", "-1",
        "--ready-timeout", str(timeout - 10),
        *extra,
    ]  # fmt: skip
    t0 = time.monotonic()
    with open(out_path, "wb") as out:
        # Its own process group, as a shell gives a foreground job: a Ctrl-C can then be sent to it.
        proc = subprocess.Popen(
            argv,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
            start_new_session=True,
        )
    cluster = Cluster(proc, data_dir, out_path, {}, 0.0)

    def ready() -> dict[str, Any]:
        """up.json once it says ready; empty (not yet) before."""
        state = _read_state(data_dir / "up.json")
        if state is not None and state.get("ready"):
            return state
        assert proc.poll() is None, f"llmgw up exited with {proc.returncode}"
        return {}

    try:
        with shown_on_failure(cluster.diagnostics):
            cluster.state = eventually_sync(ready, timeout=timeout, every=0.2, what="llmgw up to be ready")
    except AssertionError:
        stop_up(cluster)
        raise
    cluster.started_s = time.monotonic() - t0
    return cluster


def stop_up(cluster: Cluster, timeout: float = 90.0, *, whole_group: bool = False) -> int:
    """SIGINT; SIGKILL only if it does not stop in time. Returns its exit code.

    ``whole_group``: to its whole process group, as a terminal's Ctrl-C does (the embedded
    nats-server, in that group, gets it too); otherwise to `llmgw up` alone, as ``kill -INT`` does.
    """
    if cluster.proc.poll() is None:
        if whole_group:
            os.killpg(cluster.proc.pid, signal.SIGINT)
        else:
            cluster.proc.send_signal(signal.SIGINT)
        try:
            cluster.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            cluster.proc.kill()
            cluster.proc.wait()
    return cluster.proc.returncode


def chat_once(cluster: Cluster, model: str, timeout: float = 10.0) -> httpx.Response:
    return httpx.post(
        f"{cluster.base_url}/chat/completions",
        headers={"Authorization": f"Bearer {cluster.key}"},
        json={"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
        timeout=timeout,
    )


def wait_model(cluster: Cluster, model: str, timeout: float = 60.0) -> None:
    """Poll until a chat completion for ``model`` succeeds; fail with the last answer otherwise."""
    last = ""

    def serves() -> bool:
        nonlocal last
        try:
            r = chat_once(cluster, model)
        except httpx.HTTPError as e:
            last = repr(e)
            return False
        last = f"{r.status_code} {r.text[:300]}"
        return r.status_code == 200

    with shown_on_failure(lambda: f"last answer: {last}\n{cluster.diagnostics()}"):
        eventually_sync(serves, timeout=timeout, every=0.5, what=f"{model} to serve a chat completion")
