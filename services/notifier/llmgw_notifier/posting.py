"""POSTing one rendered message to a webhook until it is taken: the retry policy.

Any non-2xx answer, transport error or other error the HTTP client raises for the request is a failed
attempt. Attempts are spaced by exponential backoff from ``retry_base_s`` to ``retry_max_s``, jittered,
and never sooner than the receiver's ``Retry-After`` (Slack's 429); after ``retry_for_s`` the
:class:`Outcome` says not taken, and the caller gives up (``delivery.py``).
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import httpx

from llmgw_common import backoff
from llmgw_common.urls import shown_url
from llmgw_notifier.formats import Rendered
from llmgw_notifier.settings import NotifierSettings
from llmgw_notifier.stats import NotifierStats

log = logging.getLogger("llmgw.notifier.posting")


def retry_after_s(resp: httpx.Response) -> float | None:
    """A receiver's ``Retry-After`` in seconds (Slack sends it with 429); None when absent or a date."""
    value = resp.headers.get("retry-after")
    if value is None:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        return None


@dataclass(frozen=True, slots=True)
class Outcome:
    ok: bool
    attempts: int
    last_error: str | None


async def post_until_taken(
    client: httpx.AsyncClient,
    url: str,
    msg: Rendered,
    s: NotifierSettings,
    *,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    rng: Callable[[], float] = random.random,
    stats: NotifierStats | None = None,
) -> Outcome:
    """POST ``msg`` until the receiver answers 2xx or ``s.retry_for_s`` has passed."""
    deadline = clock() + s.retry_for_s
    attempt = 0
    while True:
        attempt += 1
        wait_hint: float | None = None
        try:
            resp = await client.post(url, content=msg.body, headers=msg.headers, timeout=s.http_timeout_s)
        except Exception as e:
            # Besides httpx.HTTPError, httpx raises plain errors (UnicodeError, InvalidURL) for a URL it
            # cannot encode: a failed attempt too. Escaping, it killed the worker, and the restarted one
            # met the same event first again, forever.
            error = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
            error = error.replace(url, shown_url(url))  # the URL may be a credential (Slack)
        else:
            if 200 <= resp.status_code < 300:
                return Outcome(True, attempt, None)
            error = f"HTTP {resp.status_code}: {resp.text[:200]!r}"
            wait_hint = retry_after_s(resp)
        if stats is not None:
            stats.failed_attempts += 1
        now = clock()
        if now >= deadline:
            return Outcome(False, attempt, error)
        delay = backoff.jittered_delay(attempt, s.retry_base_s, s.retry_max_s, rng())
        if wait_hint is not None:
            delay = max(delay, wait_hint)
        delay = min(delay, deadline - now)
        level = logging.WARNING if attempt == 1 or attempt % 10 == 0 else logging.DEBUG
        log.log(
            level,
            "webhook %s did not take %s (attempt %d: %s); retrying in %.1fs",
            shown_url(url),
            msg.id,
            attempt,
            error,
            delay,
        )
        await sleep(delay)
