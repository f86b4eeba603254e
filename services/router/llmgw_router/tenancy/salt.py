"""The ``cache_salt`` an engine gets, by the key's cache scope (``ApiKeyRecord.cache_scope``).

Prefix-cache timing is a side channel between tenants: a request whose prompt begins as another
tenant's did is answered faster. vLLM keeps requests with different ``cache_salt`` from sharing cached
blocks, so a key kept apart (scope ``team`` or ``key``) has its requests salted with a value naming its
team or itself (``llmgw_common.kvcache.tenant_salt``), its client's own salt appended. A client's salt
in the gateway's namespace is refused, whatever its key's scope: it would let one tenant probe another's
prefixes. The body is rewritten only for a key kept apart (one JSON dump), never for a shared key.
"""

from __future__ import annotations

from typing import Any

from llmgw_common.kvcache import RESERVED_SALT_PREFIX, SaltRefused, tenant_salt
from llmgw_common.messages import ApiKeyRecord, CacheScope
from llmgw_router.errors import RouterError, error_response


def salt_for(rec: ApiKeyRecord | None, req: dict[str, Any]) -> str | RouterError | None:
    """The salt the engine is to get (set in ``req`` when it differs from the client's), or the 400."""
    client = req.get("cache_salt")
    shared = rec is None or rec.cache_scope is CacheScope.SHARED
    if shared and not (isinstance(client, str) and client.startswith(RESERVED_SALT_PREFIX)):
        # As it came: the engine judges a malformed salt itself, in its own words.
        return client if isinstance(client, str) else None
    if client is not None and (not isinstance(client, str) or not client):
        return error_response(400, "cache_salt must be a non-empty string", param="cache_salt")
    try:
        salt = tenant_salt(
            CacheScope.SHARED if rec is None else rec.cache_scope,
            "" if rec is None else rec.id,
            None if rec is None else rec.team,
            client,
        )
    except SaltRefused as e:
        return error_response(400, str(e), param="cache_salt")
    if salt is not None and salt != client:
        req["cache_salt"] = salt
    return salt
