"""httpx clients for tests, all sharing one TLS context made once, at import.

httpx builds a new SSLContext for every client it makes (loading a CA bundle: 0.1-0.3 s of CPU on
a loaded box). In a test's loop that is a callback blocking the loop, which asyncio debug mode reports,
and which stalls the test's own bus client meanwhile. Tests speak plain HTTP to local servers, so the
context is never used for a handshake; sharing it only removes the cost.
"""

from __future__ import annotations

import importlib
import ssl
from typing import Any

import httpcore  # noqa: F401
import httpx

TLS = ssl.create_default_context()

# A client's first request imports its transport's modules (httpcore, anyio's asyncio backend), in the
# test's loop: some 50 ms on an idle box, several times that on a loaded one. Here they load at import.
importlib.import_module("anyio._backends._asyncio")


def async_client(**kwargs: Any) -> httpx.AsyncClient:
    """``httpx.AsyncClient(**kwargs)`` without building a TLS context of its own."""
    return httpx.AsyncClient(verify=TLS, **kwargs)
