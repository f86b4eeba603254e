"""``make compose-test``: the container dev cluster of docker-compose.yml built, started and served.

What a user does, for real: ``docker-compose up --build -d``, the development key from the ``devkey``
service's log, a chat through the router. Then the checks of the ``llmgw up`` end-to-end tests that
apply to containers (models listed, chats, a stream, a wrong key and an unknown model refused), the
notifier's probes of the watched model let through with the compose cluster's probe key, an agent
container stopped and its ``node.lost`` delivered to a webhook receiver, and ``down`` then ``up``
again on the kept volumes (the same key, served again). Finally ``down -v --rmi all``: no container,
volume, network or image of the run is left, whatever happened; only the base image stays cached.

On the machines this project is built on no registry is reachable: the base image is made from Debian
packages (``tests/compose/base_image.py``) and passed as ``LLMGW_BASE_IMAGE``, which a user with the
official images never sets. docker.io, docker-compose and debootstrap are installed when missing, and
``dockerd`` is started when none answers, and then stopped again (only a daemon this run started).

Not a pytest module (pytest collects ``test_*.py`` only): a run takes minutes and needs root. It ends
``compose-test: skipped: <why>`` with status 0 where Docker cannot run here.

    python -m tests.compose.run
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import FrameType
from typing import Any, TypeVar

import httpx
import openai
from openai.types.chat import ChatCompletion

from tests.compose.base_image import ensure_base_image, image_exists
from tests.kit.ports import free_port

REPO = Path(__file__).resolve().parents[2]
OFFICIAL_BASE = "python:3.11-slim"
# examples/catalog.yaml, which the compose file's control plane loads.
CHAT_MODEL = "llama-3.1-8b"
CPU_MODEL = "tiny-cpu"
CODER_MODEL = "qwen2.5-coder-7b"  # only on gpu-b1 (node selector role=coding)
WATCHED_MODEL = "llama-3.1-70b"  # watch: probe_every 30s
CATALOG_MODELS = {CHAT_MODEL, CPU_MODEL, CODER_MODEL, WATCHED_MODEL}
LOST_SERVICE, LOST_NODE = "agent-b", "gpu-b1"
# A key is "llmgw-" and URL-safe base64 ('-' and '_' included), alone on its log line.
KEY_RE = re.compile(r"(?:^|\s)(llmgw-[A-Za-z0-9_-]{20,})\s*$", re.MULTILINE)
# Generous: a loaded 2-core box builds and starts eight containers; the router holds requests while
# replicas start (a 503 only after a model's queue_timeout_s, 30 s; the tally printed shows any).
FIRST_CHAT_TIMEOUT_S = 240.0
# node_lost_s is 30 s by default (the compose file leaves it): lost, then delivered, within this.
NODE_LOST_TIMEOUT_S = 150.0

T = TypeVar("T")


class Skip(Exception):
    """Docker cannot run on this machine: the run ends with status 0 and says why."""


def say(msg: str) -> None:
    print(f"compose-test: {msg}", flush=True)


def run(
    args: list[str],
    *,
    check: bool = True,
    timeout: float = 600.0,
    env: dict[str, str] | None = None,
) -> subprocess.CompletedProcess[str]:
    """A command's output, captured (it is shown when the command fails, unless ``check`` is off)."""
    p = subprocess.run(
        args, cwd=REPO, env=env, text=True, capture_output=True, timeout=timeout, stdin=subprocess.DEVNULL
    )
    if check and p.returncode != 0:
        raise RuntimeError(f"{' '.join(args)} exited {p.returncode}:\n{p.stdout[-3000:]}{p.stderr[-3000:]}")
    return p


def wait_for(check: Callable[[], T | None], *, timeout: float, every: float = 0.5, what: str) -> T:
    """``check()`` until it returns something, within ``timeout``; the failure names what never came."""
    deadline = time.monotonic() + timeout
    last: object = None
    while True:
        try:
            got = check()
        except (httpx.HTTPError, openai.APIError, OSError) as e:  # not up yet
            got, last = None, e
        if got is not None:
            return got
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g}s waiting for {what} (last: {last!r})")
        time.sleep(every)


# ---------------------------------------------------------------- Docker on this machine


TOOLS = {"dockerd": "docker.io", "docker": "docker.io", "docker-compose": "docker-compose"}


def install_tools(need_debootstrap: bool) -> None:
    """Debian's docker.io, docker-compose (v1) and debootstrap, when missing (apt-get update once)."""
    tools = dict(TOOLS, **({"debootstrap": "debootstrap"} if need_debootstrap else {}))
    missing = sorted({pkg for cmd, pkg in tools.items() if shutil.which(cmd) is None})
    if not missing:
        return
    if sys.platform != "linux" or shutil.which("apt-get") is None:
        raise Skip(f"{', '.join(missing)} missing and no apt-get to install them")
    if os.geteuid() != 0:
        raise Skip(f"{', '.join(missing)} missing, and installing them needs root")
    say(f"installing {' '.join(missing)}")
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    lock = ["-o", "DPkg::Lock::Timeout=600"]
    for cmd in (["apt-get", "update", "-qq"], ["apt-get", "install", "-y", "-qq", *lock, *missing]):
        p = run(["nice", *cmd], check=False, env=env, timeout=1200)
        if p.returncode != 0:
            raise Skip(f"could not install {' '.join(missing)}: {(p.stderr or p.stdout).strip()[-500:]}")


def docker_answers() -> bool:
    return run(["docker", "info"], check=False, timeout=30).returncode == 0


@contextlib.contextmanager
def docker_daemon(workdir: Path) -> Iterator[None]:
    """A Docker daemon that answers: the running one, else one started here and stopped at the end."""
    if docker_answers():
        yield
        return
    if os.geteuid() != 0:
        raise Skip("no Docker daemon answers, and starting one needs root")
    log_path = workdir / "dockerd.log"
    say("starting dockerd (none answers)")
    with open(log_path, "wb") as log_file:
        # nice: the daemon's builds and containers inherit it, on a machine shared with other builds.
        daemon = subprocess.Popen(
            ["nice", "-n", "10", "dockerd"], stdout=log_file, stderr=subprocess.STDOUT, start_new_session=True
        )
    try:
        deadline = time.monotonic() + 60
        while not docker_answers():
            if daemon.poll() is not None or time.monotonic() > deadline:
                tail = log_path.read_text(errors="replace")[-1500:]
                raise Skip(f"dockerd could not start here (exit {daemon.poll()}):\n{tail}")
            time.sleep(0.5)
        yield
    finally:
        if daemon.poll() is None:
            say("stopping the dockerd this run started")
            daemon.send_signal(signal.SIGTERM)
            try:
                daemon.wait(timeout=60)
            except subprocess.TimeoutExpired:
                daemon.kill()
                daemon.wait()


def base_image() -> str:
    """The image's base: ``LLMGW_BASE_IMAGE`` if set, the official one if present, else the local one."""
    if given := os.environ.get("LLMGW_BASE_IMAGE"):
        return given
    if image_exists("docker", OFFICIAL_BASE):
        return OFFICIAL_BASE
    if os.geteuid() != 0:
        raise Skip(f"no {OFFICIAL_BASE} here and building a local base image needs root (debootstrap)")
    return ensure_base_image()


# ---------------------------------------------------------------- the compose project


def source_tree(dest: Path) -> Path:
    """A frozen copy of what the build uses, so that all eight services' images come from one tree.

    ``LLMGW_COMPOSE_REV`` (a git revision): its committed files. Else the working tree's files as git
    sees them (tracked, and untracked ones it does not ignore): a user's checkout, edits included.
    """
    dest.mkdir()
    if rev := os.environ.get("LLMGW_COMPOSE_REV"):
        archive = subprocess.Popen(["git", "archive", rev], cwd=REPO, stdout=subprocess.PIPE)
        try:
            subprocess.run(["tar", "-x", "-C", str(dest)], stdin=archive.stdout, check=True)
        finally:
            if archive.stdout is not None:
                archive.stdout.close()
            if archive.wait() != 0:
                raise RuntimeError(f"git archive {rev} failed (exit {archive.returncode})")
        return dest
    listed = run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], check=False)
    if listed.returncode != 0:  # not a git checkout: the whole tree, less what is never built
        shutil.copytree(
            REPO,
            dest,
            dirs_exist_ok=True,
            ignore=shutil.ignore_patterns(".git", ".venv", ".llmgw", "__pycache__"),
        )
        return dest
    for name in listed.stdout.split("\0"):
        src = REPO / name
        if name and src.is_file():  # a tracked file deleted in the working tree is not built
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / name)
    return dest


@dataclass
class Project:
    """One run's compose project: its own name, image and host ports, so nothing of a user's is touched."""

    name: str
    base: str
    src: Path  # the frozen tree: its docker-compose.yml, build context and catalog
    # Free on every interface: compose publishes them there.
    router_port: int = field(default_factory=lambda: free_port(""))
    nats_port: int = field(default_factory=lambda: free_port(""))

    @property
    def image(self) -> str:
        return f"llmgw-compose-test:{self.name}"

    @property
    def env(self) -> dict[str, str]:
        return dict(
            os.environ,
            LLMGW_BASE_IMAGE=self.base,
            LLMGW_IMAGE=self.image,
            LLMGW_ROUTER_PORT=str(self.router_port),
            LLMGW_NATS_PORT=str(self.nats_port),
        )

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.router_port}/v1"

    def compose(
        self, *args: str, check: bool = True, timeout: float = 900.0
    ) -> subprocess.CompletedProcess[str]:
        cmd = [
            "docker-compose",
            "--no-ansi",
            "-f",
            str(self.src / "docker-compose.yml"),
            "-p",
            self.name,
            *args,
        ]
        return run(cmd, check=check, timeout=timeout, env=self.env)

    def logs(self, service: str) -> str:
        return self.compose("logs", "--no-color", service, check=False, timeout=60).stdout

    def labelled(self, kind: str) -> list[str]:
        """The project's containers, volumes or networks that exist now."""
        flag = ["-a"] if kind == "container" else []
        cmd = ["docker", kind, "ls", *flag, "-q", "--filter", f"label=com.docker.compose.project={self.name}"]
        return run(cmd, timeout=60).stdout.split()

    def diagnostics(self) -> None:
        say("diagnostics: docker-compose ps, then each service's log tail")
        print(self.compose("ps", check=False, timeout=60).stdout, flush=True)
        services = self.compose("config", "--services", check=False, timeout=60).stdout.split()
        for svc in services:
            tail = self.logs(svc).splitlines()[-40:]
            print(f"---- {svc}\n" + "\n".join(tail), flush=True)

    def down(self) -> list[str]:
        """Remove everything of the run; what is still there afterwards (after removing it by force)."""
        self.compose("down", "-v", "--rmi", "all", "--remove-orphans", "-t", "10", check=False)
        left: list[str] = []
        for kind in ("container", "volume", "network"):
            for item in self.labelled(kind):
                left.append(f"{kind} {item}")
                run(
                    ["docker", kind, "rm", "-f", item]
                    if kind == "container"
                    else ["docker", kind, "rm", item],
                    check=False,
                )
        if image_exists("docker", self.image):
            left.append(f"image {self.image}")
            run(["docker", "image", "rm", "-f", self.image], check=False)
        return left


# ---------------------------------------------------------------- a webhook receiver on the host


class Receiver:
    """A real HTTP receiver on every host address: the notifier, in a container, posts to the host
    through the compose network's gateway."""

    def __init__(self) -> None:
        self.bodies: list[Any] = []
        received = self.bodies

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                n = int(self.headers.get("Content-Length") or 0)
                raw = self.rfile.read(n)
                try:
                    received.append(json.loads(raw))
                except ValueError:
                    received.append({"unparsed": raw.decode(errors="replace")})
                self.send_response(200)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, format: str, *args: Any) -> None:
                pass  # the run's own lines say what arrived

        self.server = ThreadingHTTPServer(("0.0.0.0", 0), Handler)
        self.port: int = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, name="receiver", daemon=True)
        self.thread.start()

    def events(self) -> list[dict[str, Any]]:
        """Every event received, a group's members one by one (json format)."""
        out: list[dict[str, Any]] = []
        for b in list(self.bodies):
            if isinstance(b, dict):
                out.extend(e for e in b.get("events", [b]) if isinstance(e, dict))
        return out

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


# ---------------------------------------------------------------- the checks


def dev_key(p: Project, timeout: float = 120.0) -> tuple[str, str]:
    """The key the ``devkey`` service printed on this ``up``, and its last log line."""

    def printed() -> tuple[str, str] | None:
        log = p.logs("devkey")
        keys = KEY_RE.findall(log)
        said = [ln for ln in log.splitlines() if "development key" in ln]
        return (keys[-1], said[-1]) if keys and said else None

    return wait_for(
        printed, timeout=timeout, every=1.0, what="the development key in the devkey service's log"
    )


def first_chat(p: Project, key: str, t0: float) -> float:
    """Seconds from ``t0`` to the first chat completion the router serves, polling every 0.5 s."""
    seen: dict[int, int] = {}

    def served() -> float | None:
        r = httpx.post(
            f"{p.base_url}/chat/completions",
            headers={"Authorization": f"Bearer {key}"},
            json={"model": CHAT_MODEL, "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 4},
            timeout=15,
        )
        seen[r.status_code] = seen.get(r.status_code, 0) + 1
        if r.status_code == 200:
            assert r.json()["choices"][0]["message"]["content"], r.text
            return time.monotonic() - t0
        # Anything else is "not yet": 503 before the replicas serve, 401 and 404 while the router has
        # not read the key or the catalog. The tally of what came first is part of the result; a key
        # still refused after 20 s is a wrong key, not a slow router.
        if seen.get(401, 0) > 40:
            raise AssertionError(f"the router keeps refusing the development key: {r.text}")
        return None

    took = wait_for(served, timeout=FIRST_CHAT_TIMEOUT_S, what=f"a served chat with {CHAT_MODEL}")
    say(f"first chat served {took:.1f} s after up (answers before it: {seen})")
    return took


def check_openai(p: Project, key: str) -> None:
    """The checks of tests/e2e/test_e2e_openai.py that apply, through the official client."""
    client = openai.OpenAI(base_url=p.base_url, api_key=key, max_retries=0, timeout=30)
    ids = {m.id for m in client.models.list()}
    assert CATALOG_MODELS <= ids, f"models listed: {sorted(ids)}"
    for model in (CHAT_MODEL, CPU_MODEL, CODER_MODEL):

        def chat(m: str = model) -> ChatCompletion:
            return client.chat.completions.create(
                model=m, messages=[{"role": "user", "content": "Say hello"}], max_tokens=8
            )

        # Each model's replicas start on their own: held or 503 until theirs is ready.
        r = wait_for(chat, timeout=120, what=f"a chat with {model}")
        assert r.model == model and r.choices[0].message.role == "assistant", r
        assert r.choices[0].message.content and r.usage is not None and r.usage.completion_tokens > 0, r
    stream = client.chat.completions.create(
        model=CHAT_MODEL, messages=[{"role": "user", "content": "Count"}], max_tokens=8, stream=True
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(chunks) >= 2 and text, f"stream: {len(chunks)} chunks, text {text!r}"
    assert len(finishes) == 1 and finishes[0] in ("stop", "length"), finishes
    try:
        client.chat.completions.create(model="no-such-model", messages=[{"role": "user", "content": "x"}])
        raise AssertionError("an unknown model was served")
    except openai.NotFoundError:
        pass
    bad = openai.OpenAI(base_url=p.base_url, api_key="llmgw-wrong", max_retries=0, timeout=30)
    try:
        bad.chat.completions.create(model=CPU_MODEL, messages=[{"role": "user", "content": "x"}])
        raise AssertionError("a wrong key was let through")
    except openai.AuthenticationError:
        pass
    say(
        f"models listed, chats with {CHAT_MODEL}, {CPU_MODEL}, {CODER_MODEL}, a stream ({len(chunks)} chunks), 404 and 401: ok"
    )


def check_probe_key(p: Project, key: str) -> None:
    """The notifier runs with the development key as its probe key (what `llmgw up` gives it)."""
    env = p.compose("exec", "-T", "notifier", "cat", "/proc/1/environ", timeout=60).stdout
    assert f"LLMGW_PROBE_KEY={key}" in env.split("\0"), "the notifier's probe key is not the dev key"


def check_probes_let_through(p: Project) -> None:
    """After the probes of the watched model (one at the notifier's start, then every 30 s), none was
    refused for its key."""
    log = p.logs("notifier")
    assert f"probing {WATCHED_MODEL}" in log, f"the notifier never probed {WATCHED_MODEL}:\n{log[-2000:]}"
    refused = [ln for ln in log.splitlines() if "probe key" in ln]
    assert not refused, f"probes refused for their key:\n{refused}"


def gateway(p: Project) -> str:
    """The host's address on the project's network, which its containers reach the host by."""
    net = f"{p.name}_default"
    out = run(["docker", "network", "inspect", net, "-f", "{{range .IPAM.Config}}{{.Gateway}} {{end}}"])
    gw = out.stdout.split()
    assert gw, f"network {net} has no gateway"
    return gw[0]


def check_node_lost(p: Project, rx: Receiver) -> None:
    """A webhook set with `llmgw setup` in a container; an agent's container stopped: its node.lost
    reaches the receiver."""
    url = f"http://{gateway(p)}:{rx.port}/hook"
    p.compose(
        "exec",
        "-T",
        "controlplane",
        "llmgw",
        "setup",
        "--no-input",
        "--webhook",
        url,
        "--webhook-format",
        "json",
        timeout=60,
    )
    t0 = time.monotonic()
    p.compose("stop", "-t", "10", LOST_SERVICE, timeout=120)
    say(f"stopped {LOST_SERVICE} (node {LOST_NODE}); waiting for node.lost at {url}")

    def lost() -> dict[str, Any] | None:
        return next(
            (e for e in rx.events() if e.get("kind") == "node.lost" and e.get("subject") == LOST_NODE), None
        )

    ev = wait_for(
        lost, timeout=NODE_LOST_TIMEOUT_S, every=1.0, what=f"node.lost of {LOST_NODE} at the receiver"
    )
    say(
        f"node.lost of {LOST_NODE} received {time.monotonic() - t0:.0f} s after the stop: {ev.get('summary')}"
    )


# ---------------------------------------------------------------- the run


def cold_and_warm(p: Project, rx: Receiver) -> dict[str, float]:
    took: dict[str, float] = {}
    t0 = time.monotonic()
    p.compose("build", timeout=1800)
    took["build"] = time.monotonic() - t0
    say(f"image {p.image} built in {took['build']:.0f} s (base {p.base})")

    t0 = time.monotonic()
    p.compose("up", "--build", "-d", timeout=600)
    say(f"up --build -d returned after {time.monotonic() - t0:.1f} s (eight cached builds, NATS, the key)")
    key, said = dev_key(p)
    assert "minted" in said, said
    took["cold"] = first_chat(p, key, t0)
    check_probe_key(p, key)
    check_openai(p, key)
    check_node_lost(p, rx)
    check_probes_let_through(p)

    # Again on the kept volumes (NATS store, key file): the same key, served again.
    p.compose("down", "-t", "10", timeout=300)
    t0 = time.monotonic()
    p.compose("up", "-d", timeout=600)
    say(f"up -d returned after {time.monotonic() - t0:.1f} s")
    again, said = dev_key(p)
    assert again == key and "reused" in said, f"the second up printed another key: {said}"
    took["warm"] = first_chat(p, key, t0)
    return took


def main() -> int:
    # `timeout` (or Ctrl-C) ends the run through its finally blocks: nothing is left behind.
    def stop(signum: int, frame: FrameType | None) -> None:
        raise SystemExit(f"compose-test: stopped by signal {signum}")

    signal.signal(signal.SIGTERM, stop)
    t_start = time.monotonic()
    try:
        if sys.platform != "linux":
            raise Skip(f"Docker's Linux containers need Linux, not {sys.platform}")
        with tempfile.TemporaryDirectory(prefix="llmgw-compose-") as tmp:
            need_debootstrap = "LLMGW_BASE_IMAGE" not in os.environ
            install_tools(need_debootstrap)
            with docker_daemon(Path(tmp)):
                base = base_image()
                src = source_tree(Path(tmp) / "src")
                project = Project(name=f"llmgwct{os.getpid()}", base=base, src=src)
                rx = Receiver()
                dangling_before = set(
                    run(["docker", "images", "-q", "--filter", "dangling=true"]).stdout.split()
                )
                ok = False
                try:
                    took = cold_and_warm(project, rx)
                    ok = True
                finally:
                    if not ok:
                        project.diagnostics()
                    rx.close()
                    left = project.down()
                    # Layers of this run's image that its removal left untagged (a rebuilt tag's old
                    # image): not the daemon's cache, so removed too.
                    dangling = set(
                        run(["docker", "images", "-q", "--filter", "dangling=true"]).stdout.split()
                    )
                    for image in sorted(dangling - dangling_before):
                        run(["docker", "image", "rm", image], check=False)
                if left:
                    raise AssertionError(f"down left behind: {', '.join(left)}")
    except Skip as e:
        say(f"skipped: {e}")
        return 0
    say(
        f"passed in {time.monotonic() - t_start:.0f} s: image build {took['build']:.0f} s, "
        f"up to first served chat {took['cold']:.1f} s cold (new volumes), {took['warm']:.1f} s warm "
        "(kept volumes)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
