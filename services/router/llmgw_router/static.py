"""Static mode: a fixed list of models and endpoint URLs from a YAML file, no control plane, no NATS.

auth: true            # optional; default: on when keys are listed, else off
keys:                 # optional; hashes only (sha256 hex of the key, `llmgw keys hash`)
  - name: dev
    hash: 3f1c...
    models: [tiny]    # optional; absent: every model
models:
  - name: tiny
    endpoints: [http://127.0.0.1:9001, http://127.0.0.1:9002]
    max_concurrency: 64   # optional, any catalog profile field

The file is validated like the catalog and the fleet file: the top level is a strict pydantic model
(``auth: "false"`` is an error, not a true string), each model and key is validated on its own by
:func:`llmgw_common.validation.validate_named` (duplicates included), and every problem is listed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, StrictBool, ValidationError, field_validator

from llmgw_common.catalog import Catalog, ModelProfile, identity_problems
from llmgw_common.messages import ApiKeyRecord, CacheScope, Endpoint, RoutingEndpoints
from llmgw_common.urls import http_url_problem
from llmgw_common.validation import ProblemsError, describe, document_mapping, read_document, validate_named


class StaticConfigError(ProblemsError):
    """A static file that cannot be used; ``problems`` lists every reason."""

    document = "static file"


@dataclass(frozen=True, slots=True)
class StaticConfig:
    catalog: Catalog
    routing: RoutingEndpoints
    keys: tuple[ApiKeyRecord, ...]
    auth: bool


class _StaticFile(BaseModel):
    """The top level; the entries of ``models`` and ``keys`` are validated one by one below."""

    model_config = ConfigDict(extra="forbid")

    auth: StrictBool | None = None
    keys: list[Any] = Field(default_factory=list)
    models: list[Any] = Field(default_factory=list)

    @field_validator("keys", "models", mode="before")
    @classmethod
    def _empty(cls, v: Any) -> Any:
        return [] if v is None else v  # `keys:` with nothing under it


class StaticModel(ModelProfile):
    """A catalog profile plus the URLs that serve it. The engine only labels it here."""

    engine: str = "sim"
    endpoints: tuple[str, ...] = ()

    @field_validator("endpoints", mode="before")
    @classmethod
    def _urls(cls, v: Any) -> Any:
        if v is None:
            return ()
        if not isinstance(v, list | tuple):
            raise ValueError("'endpoints' must be a list of http(s) URLs")
        bad = [u for u in v if not _is_http_url(u)]
        if bad:
            raise ValueError(", ".join(f"{u!r} is not an http(s) URL" for u in bad))
        return tuple(u.rstrip("/") for u in v)


class StaticKey(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str
    hash: str = Field(pattern=r"^[0-9A-Fa-f]{64}$", description="sha256 hex of the key")
    models: tuple[str, ...] | None = None
    id: str | None = None
    expires: float | None = None
    # With whom its requests share cached prompt prefixes on the engines (ApiKeyRecord.cache_scope).
    cache_scope: CacheScope = CacheScope.SHARED


def _is_http_url(u: Any) -> bool:
    return isinstance(u, str) and http_url_problem(u) is None


def _model_checks(m: StaticModel) -> list[str]:
    where = f"model {m.name!r}"
    out = identity_problems(m)
    seen: set[str] = set()
    for u in m.endpoints:
        if u in seen:
            out.append(f"{where}: endpoint {u!r} is listed twice")
        seen.add(u)
    return out


def parse_static(data: Any) -> StaticConfig:
    """A validated static file from a mapping or YAML text; StaticConfigError lists every problem."""
    data = document_mapping(data, StaticConfigError, "a static file is a mapping with a 'models' list")
    problems: list[str] = []
    try:
        top = _StaticFile.model_validate(data)
    except ValidationError as e:
        problems.extend(describe("static file", e))
        # Go on with whichever lists are lists, so their problems are listed in the same round.
        lists = {k: v if isinstance(v := data.get(k), list) else [] for k in ("models", "keys")}
        top = _StaticFile.model_construct(auth=None, models=lists["models"], keys=lists["keys"])
    models, found = validate_named(
        top.models, StaticModel, kind="model", list_name="models", checks=_model_checks
    )
    problems.extend(found)
    names = {m.name for m in models}
    hashes: dict[str, str] = {}

    def key_checks(k: StaticKey) -> list[str]:
        out = [f"key {k.name!r}: model {m!r} is not in this file" for m in k.models or () if m not in names]
        h = k.hash.lower()
        if h in hashes:
            out.append(f"key {k.name!r}: the same hash as key {hashes[h]!r} (one key, two names)")
        else:
            hashes[h] = k.name
        return out

    keys, found = validate_named(top.keys, StaticKey, kind="key", list_name="keys", checks=key_checks)
    problems.extend(found)
    if problems:
        raise StaticConfigError(problems)
    profiles = [ModelProfile.model_validate(m.model_dump(exclude={"endpoints"})) for m in models]
    endpoints = {
        m.name: tuple(
            Endpoint(replica_id=f"static-{m.name}-{j}", model=m.name, url=u, node="static")
            for j, u in enumerate(m.endpoints)
        )
        for m in models
    }
    records = tuple(
        ApiKeyRecord(
            id=k.id or f"static-{i}",
            name=k.name,
            hash=k.hash.lower(),
            models=k.models,
            created=0.0,
            expires=k.expires,
            cache_scope=k.cache_scope,
        )
        for i, k in enumerate(keys)
    )
    return StaticConfig(
        catalog=Catalog(models=tuple(profiles)),
        routing=RoutingEndpoints(version=0, endpoints=endpoints),
        keys=records,
        auth=bool(records) if top.auth is None else top.auth,
    )


def load_static(path: str) -> StaticConfig:
    return parse_static(read_document(path, StaticConfigError))
