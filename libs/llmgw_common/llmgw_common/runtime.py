"""Process plumbing shared by every service: logging, the event loop, signals."""

from __future__ import annotations

import asyncio
import logging
import signal
import sys
from collections.abc import Awaitable, Callable

from llmgw_common.names import VisibleFormatter


def setup_logging(level: str = "INFO", name: str = "llmgw") -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(VisibleFormatter(f"%(asctime)s %(levelname)s {name} %(name)s: %(message)s"))
    logging.basicConfig(level=getattr(logging, level.upper(), logging.INFO), handlers=[handler])


def run_service(main: Callable[[asyncio.Event], Awaitable[None]]) -> None:
    """Run ``main(stop)`` on uvloop where available; SIGTERM and SIGINT set ``stop``."""

    async def runner() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await main(stop)

    try:
        import uvloop

        uvloop.run(runner())
    except ImportError:
        asyncio.run(runner())
