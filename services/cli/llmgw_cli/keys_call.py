"""One ``llmgw keys`` operation on the bus: connect (the ``<prefix>_keys`` bucket made if missing), run
it, close; NATS away is a message and exit 1, JetStream not answering one and exit 69."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import typer

T = TypeVar("T")

# How long a key operation is retried while JetStream has no answer for its bucket (a stream electing
# its leader: seconds, right after a cluster starts or a server is lost). Only answers that prove the
# write was not stored are retried; a timeout may have stored it, and is said as it is.
JETSTREAM_RETRY_S = 15.0


def run_on_bus(
    config: str | None,
    nats: list[str],
    prefix: str | None,
    op: Callable[[Any, str], Awaitable[T]],
    wait_s: float = 0.0,
) -> T:
    """Connect (retried for ``wait_s``, then no more), run ``op(nc, prefix)``, close; exit 1 when NATS
    is away."""
    from nats.errors import Error as NatsError
    from nats.errors import NoRespondersError
    from nats.js.errors import NoStreamResponseError, ServiceUnavailableError
    from pydantic import ValidationError

    from llmgw_common.errors import InvalidInput, Unavailable
    from llmgw_common.subjects import Subjects
    from llmgw_runtime import bus
    from llmgw_runtime.settings import BusSettings, load_settings

    urls = [u.strip() for v in nats for u in v.split(",") if u.strip()] or None
    try:
        settings = load_settings(BusSettings, config, nats_urls=urls, prefix=prefix)
    except ValidationError as e:
        raise InvalidInput(f"bad settings: {e}") from None

    # The bus client's reconnect warnings would repeat what the one error line below says.
    logging.getLogger("llmgw.bus").setLevel(logging.ERROR)

    async def main() -> T:
        deadline = time.monotonic() + wait_s
        while True:
            try:
                nc = await bus.connect(settings, "llmgw-keys", connect_timeout=3.0, wait=False)
                break
            except (OSError, TimeoutError, NatsError) as e:
                if time.monotonic() < deadline:
                    await asyncio.sleep(0.5)
                    continue
                where = ", ".join(settings.nats_urls)
                typer.echo(f"llmgw keys: cannot reach NATS at {where}: {e or type(e).__name__}", err=True)
                raise typer.Exit(1) from None
        bucket = Subjects(settings.prefix).bucket_keys
        until = time.monotonic() + max(wait_s, JETSTREAM_RETRY_S)
        try:
            while True:
                try:
                    # The bucket may not exist yet (keys made before the first control plane started):
                    # make it with the cluster's replica count, not the helpers' default of 1.
                    await bus.ensure_kv(nc.jetstream(), bucket, replicas=settings.kv_replicas)
                    return await op(nc, settings.prefix)
                except (NoStreamResponseError, NoRespondersError, ServiceUnavailableError) as e:
                    if time.monotonic() < until:
                        await asyncio.sleep(0.5)
                        continue
                    raise Unavailable(
                        f"JetStream did not answer for bucket {bucket} ({e}); its stream may be electing "
                        f"a leader (a server just started or was lost): nothing was written, try again"
                    ) from None
        finally:
            await nc.close()

    return asyncio.run(main())
