"""``llmgw up``: the whole topology on one machine, until Ctrl-C.

Order: embedded NATS (its store in ``<data-dir>/nats``, so a second run keeps desired state and
keys), the development key, control plane, router, notifier, the local agent and one agent per
simulated node of the fleet file. Then it polls a chat completion through the router until one
succeeds, prints how to use it, and keeps the run whole: a child or the nats-server that dies is
restarted with a backoff (:mod:`llmgw_cli.upkeep`). SIGINT or SIGTERM stops everything in reverse order.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import logging
import os
import secrets
import signal
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Annotated

import typer
from nats import errors as nats_errors
from nats.js.errors import NotFoundError

from llmgw_cli.devcluster import (
    Layout,
    Supervisor,
    free_port,
    log_tail,
    plan_children,
    port_in_use,
    write_state,
)
from llmgw_cli.devkey import ensure_dev_key
from llmgw_cli.fleet import Fleet, FleetError, load_fleet_file
from llmgw_cli.upopts import LOOPBACK, option_errors
from llmgw_cli.upready import STATE_FILE, wait_ready_then_serve
from llmgw_cli.upterm import StopFlag, err, out
from llmgw_common.catalog import Catalog, CatalogError, load_catalog_file
from llmgw_common.errors import LlmgwError
from llmgw_common.subjects import DESIRED_CATALOG, Subjects, check_token
from llmgw_runtime.bus import connect, ensure_all
from llmgw_runtime.natsserver import NatsServer, NatsServerError, ensure_on_path
from llmgw_runtime.settings import BusSettings

REPO_ROOT = Path(__file__).resolve().parents[3]


class UpError(LlmgwError):
    """A reason ``llmgw up`` cannot go on, in the user's terms."""


def default_example(name: str) -> Path:
    """``examples/<name>`` of the working directory if there is one, else of the source tree."""
    here = Path("examples") / name
    return here if here.exists() else REPO_ROOT / "examples" / name


@contextlib.contextmanager
def data_dir_lock(data_dir: Path) -> Iterator[None]:
    """One ``llmgw up`` per data directory: two would fight over one NATS store."""
    try:
        data_dir.mkdir(parents=True, exist_ok=True)
        f: IO[str] = open(data_dir / "up.lock", "a+", encoding="utf-8")
    except OSError as e:
        raise UpError(f"cannot use data directory {data_dir}: {e.strerror}") from None
    try:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.seek(0)
            other = f.read().strip() or "?"
            raise UpError(
                f"another `llmgw up` (pid {other}) is running with data directory {data_dir}; "
                "stop it or pass another --data-dir"
            ) from None
        f.seek(0)
        f.truncate()
        f.write(str(os.getpid()))
        f.flush()
        yield
    finally:
        f.close()


@dataclass(frozen=True, slots=True)
class BusReady:
    key: str
    minted: bool
    # The bus already held a catalog: the control plane keeps it and does not load the file.
    had_catalog: bool


async def _prepare_bus(nats_url: str, prefix: str, key_file: Path, external: bool = False) -> BusReady:
    # `up` reports its own errors; the bus helper's warnings (a "disconnected" on close) are noise here.
    logging.getLogger("llmgw.bus").setLevel(logging.ERROR)
    settings = BusSettings(nats_urls=[nats_url], prefix=prefix)
    subjects = Subjects(prefix)
    nc = await connect(settings, "llmgw-up", wait=False)
    try:
        # The embedded server is one node: R1. An existing NATS may be a cluster (LLMGW_KV_REPLICAS=3).
        buckets = await ensure_all(nc.jetstream(), subjects, replicas=settings.kv_replicas if external else 1)
        try:
            entry = await buckets[subjects.bucket_desired].get(DESIRED_CATALOG)
            had_catalog = entry.value is not None
        except NotFoundError:  # absent, or deleted
            had_catalog = False
        key, minted = await ensure_dev_key(buckets[subjects.bucket_keys], prefix, key_file)
        return BusReady(key, minted, had_catalog)
    finally:
        await nc.close()


@dataclass(frozen=True, slots=True)
class UpOptions:
    data_dir: Path = Path(".llmgw")
    fleet_file: Path = field(default_factory=lambda: default_example("fleet.yaml"))
    catalog_file: Path = field(default_factory=lambda: default_example("catalog.yaml"))
    host: str = "127.0.0.1"
    port: int = 8080
    admin_port: int = 8081
    nats_port: int = 4222
    nats_url: str | None = None
    prefix: str = "llmgw"
    local_agent: bool = True
    ready_timeout_s: float = 120.0


def run_up(opts: UpOptions) -> int:
    """The whole of ``llmgw up``; returns the exit code."""
    t0 = time.monotonic()
    stop = StopFlag(threading.Event())
    stop.install()
    try:
        return _run(opts, stop, t0)
    finally:
        stop.restore()


def _run(opts: UpOptions, stop: StopFlag, t0: float) -> int:
    ensure_on_path()
    problems = option_errors(
        host=opts.host,
        port=opts.port,
        admin_port=opts.admin_port,
        nats_port=opts.nats_port,
        ready_timeout_s=opts.ready_timeout_s,
    )
    if problems:
        err(f"error: {'; '.join(problems)}")
        return 1
    try:
        check_token(opts.prefix, "prefix")
        fleet = load_fleet_file(str(opts.fleet_file))
        catalog = load_catalog_file(str(opts.catalog_file))
    except (FleetError, CatalogError, ValueError) as e:
        err(f"error: {e}")
        return 1
    data_dir = opts.data_dir.resolve()
    try:
        with data_dir_lock(data_dir):
            return _run_locked(opts, stop, t0, data_dir, fleet, catalog)
    except UpError as e:
        err(f"error: {e}")
        return 1


def _start_nats(opts: UpOptions, data_dir: Path) -> NatsServer:
    if opts.nats_port > 0 and port_in_use(LOOPBACK, opts.nats_port):
        raise UpError(
            f"port {opts.nats_port} for NATS is in use (another llmgw up or a NATS server?): "
            "pass --nats-port -1 for a free one, or --nats URL to use that server"
        )
    (data_dir / "logs").mkdir(parents=True, exist_ok=True)
    nats = NatsServer(
        data_dir / "nats", port=opts.nats_port, host=LOOPBACK, log_file=data_dir / "logs" / "nats.log"
    )
    try:
        nats.start()
    except NatsServerError as e:
        tail = "\n".join(f"  | {line}" for line in log_tail(nats.log_file, 10))
        raise UpError(f"{e}\n{tail}") from None
    return nats


def _run_locked(
    opts: UpOptions, stop: StopFlag, t0: float, data_dir: Path, fleet: Fleet, catalog: Catalog
) -> int:
    host = opts.host
    for what, flag, h, p in (
        ("router", "--port", host, opts.port),
        ("console", "--admin-port", LOOPBACK, opts.admin_port),
    ):
        if p > 0 and port_in_use(h, p):
            raise UpError(f"port {p} for the {what} is in use: pass another {flag}, or 0 for a free one")
    nats: NatsServer | None = None
    sup: Supervisor | None = None
    try:
        if opts.nats_url is None:
            nats = _start_nats(opts, data_dir)
        nats_url = nats.url if nats is not None else str(opts.nats_url)
        try:
            bus = asyncio.run(
                _prepare_bus(nats_url, opts.prefix, data_dir / "dev-key", external=opts.nats_url is not None)
            )
        except (OSError, TimeoutError, nats_errors.Error) as e:
            raise UpError(f"cannot reach NATS at {nats_url}: {e}") from None
        layout = Layout(
            data_dir=data_dir,
            nats_url=nats_url,
            prefix=opts.prefix,
            host=host,
            router_port=opts.port or free_port(host),
            router_admin_port=free_port(LOOPBACK),
            controlplane_admin_port=opts.admin_port or free_port(LOOPBACK),
            catalog_file=opts.catalog_file.resolve(),
            dev_key=bus.key,
            local_agent=opts.local_agent,
        )
        run_token = secrets.token_hex(8)
        sup = Supervisor(layout, run_token, say=err)
        out(f"llmgw up: NATS at {nats_url}, data in {data_dir}, logs in {layout.logs_dir}/")
        if bus.minted:
            out(f"llmgw up: minted a development key ({data_dir / 'dev-key'})")
        if bus.had_catalog:
            out(
                f"llmgw up: the bus already holds a catalog (from an earlier run): {opts.catalog_file} is not loaded; "
                "change it with `llmgw ctl catalog apply FILE`"
            )
        for spec in plan_children(layout, fleet):
            if stop.is_set:
                break
            sup.start(spec)
        state: dict[str, object] = {
            "pid": os.getpid(),
            "run_token": run_token,
            "data_dir": str(data_dir),
            "router_url": layout.router_url,
            "base_url": f"{layout.router_url}/v1",
            "console_url": f"http://{LOOPBACK}:{layout.controlplane_admin_port}/",
            "router_admin_url": f"http://{LOOPBACK}:{layout.router_admin_port}/",
            "nats_url": nats_url,
            "nats_pid": nats.pid if nats is not None else None,
            "prefix": opts.prefix,
            "key": bus.key,
            "logs_dir": str(layout.logs_dir),
            "children": [{"name": c.spec.name, "pid": c.pid, "pgid": c.pgid} for c in sup.children],
            "ready": False,
        }
        write_state(data_dir / STATE_FILE, state)
        return wait_ready_then_serve(
            stop, t0, sup, nats, layout, catalog, bus.key, state, opts.ready_timeout_s
        )
    finally:
        if stop.signum is not None:
            out(f"\nllmgw up: {signal.Signals(stop.signum).name}: stopping (again to kill at once)")
        if sup is not None:
            sup.stop_all(hurry=stop.hurry)
        if nats is not None:
            nats.stop()
        if sup is not None:
            left = sup.sweep()
            for what in left:
                err(f"llmgw up: killed a process the run left behind: {what}")
        with contextlib.suppress(FileNotFoundError):
            (data_dir / STATE_FILE).unlink()
        if sup is not None or nats is not None:
            out("llmgw up: stopped")


def register(app: typer.Typer) -> None:
    @app.command("up")
    def up(
        data_dir: Annotated[
            Path, typer.Option(help="State (NATS store, key, logs) of this dev cluster")
        ] = Path(".llmgw"),
        fleet: Annotated[
            Path | None, typer.Option(help="Simulated nodes (default: examples/fleet.yaml)")
        ] = None,
        catalog: Annotated[
            Path | None,
            typer.Option(help="Catalog loaded when the bus has none (default: examples/catalog.yaml)"),
        ] = None,
        host: Annotated[
            str,
            typer.Option(
                help="Address the router (OpenAI API) binds; NATS, the console and /metrics stay on loopback"
            ),
        ] = "127.0.0.1",
        port: Annotated[int, typer.Option(help="Router (OpenAI API) port; 0: a free one")] = 8080,
        admin_port: Annotated[int, typer.Option(help="Control plane console port; 0: a free one")] = 8081,
        nats_port: Annotated[int, typer.Option(help="Embedded NATS port; -1: a free one")] = 4222,
        nats: Annotated[str | None, typer.Option(help="Use this NATS instead of starting one")] = None,
        prefix: Annotated[str, typer.Option(help="Subject and bucket prefix")] = "llmgw",
        local_agent: Annotated[
            bool, typer.Option(help="Run an agent for this machine (node 'local')")
        ] = True,
        ready_timeout: Annotated[
            float, typer.Option(help="Seconds to wait for a first chat completion")
        ] = 120.0,
    ) -> None:
        """Start NATS, control plane, router, notifier and agents on this machine, until Ctrl-C."""
        opts = UpOptions(
            data_dir=data_dir,
            fleet_file=fleet or default_example("fleet.yaml"),
            catalog_file=catalog or default_example("catalog.yaml"),
            host=host,
            port=port,
            admin_port=admin_port,
            nats_port=nats_port,
            nats_url=nats,
            prefix=prefix,
            local_agent=local_agent,
            ready_timeout_s=ready_timeout,
        )
        raise typer.Exit(run_up(opts))
