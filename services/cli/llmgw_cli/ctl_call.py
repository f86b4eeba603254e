"""One ``llmgw ctl`` request: connect, ask the control plane, close; every failure is a message and exit 1."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TypeVar

from llmgw_cli.ctl_options import fail
from llmgw_common.messages import Message
from llmgw_runtime.ctl_client import CtlClient, CtlError, CtlUnavailable

T = TypeVar("T", bound=Message)


def call(
    nats_urls: list[str] | None,
    prefix: str | None,
    config: str | None,
    timeout: float,
    fn: Callable[[CtlClient], Awaitable[T]],
) -> T:
    """Connect, ask, close; every failure becomes a message on stderr and exit code 1."""
    import nats.errors
    from pydantic import ValidationError

    from llmgw_runtime import bus
    from llmgw_runtime.settings import BusSettings, load_settings

    urls = [u.strip() for v in nats_urls or [] for u in v.split(",") if u.strip()] or None
    try:
        s = load_settings(BusSettings, config, nats_urls=urls, prefix=prefix)
    except ValidationError as e:
        raise fail(f"bad settings: {e}") from None

    async def run() -> T:
        try:
            nc = await bus.connect(s, "llmgw-ctl", connect_timeout=timeout, wait=False)
        except (nats.errors.Error, OSError, TimeoutError) as e:
            raise CtlUnavailable(
                f"cannot reach NATS at {', '.join(s.nats_urls)}: {e or type(e).__name__}"
            ) from None
        try:
            return await fn(CtlClient(nc, s.prefix, timeout=timeout))
        finally:
            await nc.close()

    try:
        return asyncio.run(run())
    except CtlError as e:
        raise fail(e.message) from None


def read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except OSError as e:
        raise fail(f"cannot read {path}: {e.strerror}") from None
