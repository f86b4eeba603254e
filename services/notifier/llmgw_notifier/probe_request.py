"""One probe: a tiny real request through a router, and what its answer says.

A probe fails when the router does not answer 2xx within the model's ``budget`` (a slow answer that
arrives within the budget is a success: a cold model is not a down one). A 401/403 says the
notifier's probe key is wrong, not that the model is down, and so does a 404 ``model_not_found`` for
a watched model (what the router answers for a model the key may not use): such a result is not
conclusive, and the prober changes nothing for it.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass

import httpx


@dataclass(frozen=True, slots=True)
class ProbeResult:
    ok: bool
    conclusive: bool
    error: str | None
    elapsed: float
    # No answer within the budget (the probe was cut there), rather than an error answer.
    over_budget: bool = False


def _error_code(resp: httpx.Response) -> str | None:
    try:
        body = resp.json()
    except ValueError:
        return None
    err = body.get("error") if isinstance(body, dict) else None
    code = err.get("code") if isinstance(err, dict) else None
    return code if isinstance(code, str) else None


def key_refusal(resp: httpx.Response, key: str | None, model: str) -> str | None:
    """What to tell the operator when the router refused the probe for its key, else None.

    401/403: no key, or one the router does not accept. 404 ``model_not_found`` for a watched model:
    the router answers so, on purpose, both for a model it does not know and for one the key may not
    use (a key cannot map the catalog), and a watched model is in the catalog the router reads: most
    likely a key restricted to other models (else a router that has not read the catalog yet). None of
    these says anything about the model; a probe refused for its key must never make it down.
    """
    status = resp.status_code
    if status in (401, 403):
        if not key:
            return (
                f"no probe key is set, and the router refused the probe (HTTP {status}): set probe_key "
                f"(LLMGW_PROBE_KEY) to a key allowed for {model}"
            )
        return f"the router refused the probe key (HTTP {status}); set probe_key to a key allowed for {model}"
    if status == 404 and _error_code(resp) == "model_not_found":
        return (
            f"the router does not serve {model} to the probe key (HTTP 404 model_not_found): the key is "
            f"probably not allowed for {model}; set probe_key to a key allowed for every watched model"
        )
    return None


async def probe_once(
    client: httpx.AsyncClient,
    router_url: str,
    key: str | None,
    model: str,
    budget: float,
    clock: Callable[[], float] = time.monotonic,
) -> ProbeResult:
    """One ``/v1/chat/completions`` request with ``max_tokens: 1``, bounded by ``budget`` overall."""
    body = {
        "model": model,
        "messages": [{"role": "user", "content": "ping"}],
        "max_tokens": 1,
        "stream": False,
    }
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    url = router_url.rstrip("/") + "/v1/chat/completions"
    t0 = clock()
    try:
        async with asyncio.timeout(budget):
            resp = await client.post(url, json=body, headers=headers, timeout=budget)
    except (TimeoutError, httpx.TimeoutException):
        return ProbeResult(False, True, f"no answer within the {budget:g}s budget", clock() - t0, True)
    except httpx.HTTPError as e:
        return ProbeResult(False, True, f"router {router_url} unreachable ({type(e).__name__})", clock() - t0)
    elapsed = clock() - t0
    refusal = key_refusal(resp, key, model)
    if refusal is not None:
        return ProbeResult(False, False, refusal, elapsed)
    if 200 <= resp.status_code < 300:
        return ProbeResult(True, True, None, elapsed)
    return ProbeResult(False, True, f"HTTP {resp.status_code}: {resp.text[:200]}", elapsed)
