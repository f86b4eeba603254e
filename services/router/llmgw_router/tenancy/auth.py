"""Which paths are served without a key, and how a key is read from a request.

Exemption rules (ARCHITECTURE #11): an entry is an exact path, except that an entry ending in ``/``
is a prefix rule — for every entry other than ``/`` itself. ``/`` is only ever exact: treating it as a
prefix would exempt everything. Prefix rules never match a path with ``.``/``..`` segments or an
empty segment, so ``/static/../v1/models`` cannot ride on ``/static/``. The path checked is the one
the router dispatches on (already decoded, without the query string).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from llmgw_router.http.request import Request


@dataclass(frozen=True, slots=True)
class Exemptions:
    exact: frozenset[str]
    prefixes: tuple[str, ...]

    @classmethod
    def parse(cls, entries: Iterable[str]) -> Exemptions:
        exact: set[str] = set()
        prefixes: list[str] = []
        for e in entries:
            if e != "/" and e.endswith("/"):
                prefixes.append(e)
            else:
                exact.add(e)
        return cls(frozenset(exact), tuple(prefixes))

    def exempt(self, path: str) -> bool:
        if path in self.exact:
            return True
        for p in self.prefixes:
            if path.startswith(p) and _clean(path):
                return True
        return False


def _clean(path: str) -> bool:
    segments = path.split("/")[1:]
    return all(s not in ("", ".", "..") for s in segments[:-1]) and segments[-1] not in (".", "..")


def bearer_key(headers: Mapping[str, str]) -> str | None:
    """The key from ``Authorization: Bearer <key>`` (or ``api-key``/``x-api-key``); None when absent."""
    auth = headers.get("Authorization")
    if auth:
        return _from_authorization(auth)
    return headers.get("x-api-key") or headers.get("api-key") or None


def request_key(request: Request) -> str | None:
    """:func:`bearer_key` of a request's headers, read from the raw list (no header dict built)."""
    auth = request.authorization
    if auth:
        return _from_authorization(auth)
    return request.header(b"x-api-key") or request.header(b"api-key") or None


def _from_authorization(auth: str) -> str | None:
    scheme, _, value = auth.partition(" ")
    if scheme.lower() == "bearer":
        value = value.strip()
        if value:
            return value
    return None
