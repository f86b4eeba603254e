"""One check for the http(s) URLs an operator gives llmgw: webhooks, static router endpoints."""

from __future__ import annotations

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
