"""The http(s) URLs an operator gives llmgw (webhooks, static router endpoints): one check, one way to log them."""

from __future__ import annotations

import hashlib
from urllib.parse import urlsplit


def http_url_problem(url: str) -> str | None:
    """Why ``url`` is not an http(s) URL a client can post to, in the operator's terms; None if it is."""
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 - raises ValueError on a port that is not a number in range
    except ValueError:
        return "is not a URL (a bracket or port that does not parse)"
    if parts.scheme not in ("http", "https"):
        return "needs http:// or https:// in front"
    if not parts.hostname:
        return "has no host"
    return None


def shown_url(url: str) -> str:
    """A webhook URL fit for logs: scheme and host only, plus a short hash to tell targets apart.
    A Slack incoming-webhook URL is itself a credential: its path must never reach a log."""
    tag = hashlib.sha256(url.encode()).hexdigest()[:8]
    try:
        parts = urlsplit(url)
    except ValueError:  # a URL that does not parse must still be loggable (it came from the bus)
        return f"{url.partition(':')[0][:10]}://?/… [{tag}]"
    return f"{parts.scheme}://{parts.netloc.rpartition('@')[2]}/… [{tag}]"
