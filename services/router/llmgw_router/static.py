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
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import yaml
from pydantic import ValidationError

from llmgw_common.catalog import Catalog, ModelProfile
from llmgw_common.messages import ApiKeyRecord, Endpoint, RoutingEndpoints
from llmgw_common.yamlsafe import load_yaml


class StaticConfigError(ValueError):
    pass


@dataclass(frozen=True, slots=True)
class StaticConfig:
    catalog: Catalog
    routing: RoutingEndpoints
    keys: tuple[ApiKeyRecord, ...]
    auth: bool


def parse_static(data: Any) -> StaticConfig:
    if isinstance(data, str | bytes):
        try:
            data = load_yaml(data)
        except yaml.YAMLError as e:
            raise StaticConfigError(f"not valid YAML: {e}") from None
    if not isinstance(data, dict):
        raise StaticConfigError("a static file is a mapping with a 'models' list")
    problems: list[str] = []
    for k in data:
        if k not in ("models", "keys", "auth"):
            problems.append(f"unknown top-level field {k!r} (known: models, keys, auth)")
    profiles: list[ModelProfile] = []
    endpoints: dict[str, tuple[Endpoint, ...]] = {}
    raw_models = data.get("models") or []
    if not isinstance(raw_models, list):
        raise StaticConfigError("'models' must be a list")
    for i, raw in enumerate(raw_models):
        if not isinstance(raw, dict) or not isinstance(raw.get("name"), str):
            problems.append(f"models[{i}]: needs a 'name'")
            continue
        raw = dict(raw)
        name = raw["name"]
        urls = raw.pop("endpoints", None) or []
        if not isinstance(urls, list) or not all(isinstance(u, str) and u.startswith("http") for u in urls):
            problems.append(f"model {name!r}: 'endpoints' must be a list of http(s) URLs")
            continue
        raw.setdefault("engine", "sim")
        try:
            profiles.append(ModelProfile.model_validate(raw))
        except ValidationError as e:
            problems.extend(f"model {name!r}: {'.'.join(map(str, x['loc']))}: {x['msg']}" for x in e.errors())
            continue
        endpoints[name] = tuple(
            Endpoint(replica_id=f"static-{name}-{j}", model=name, url=u.rstrip("/"), node="static")
            for j, u in enumerate(urls)
        )
    keys: list[ApiKeyRecord] = []
    for i, raw in enumerate(data.get("keys") or []):
        if not isinstance(raw, dict) or not isinstance(raw.get("hash"), str) or len(raw["hash"]) != 64:
            problems.append(f"keys[{i}]: needs 'hash' (sha256 hex of the key, 64 characters)")
            continue
        models = raw.get("models")
        keys.append(
            ApiKeyRecord(
                id=str(raw.get("id") or f"static-{i}"),
                name=str(raw.get("name") or f"static-{i}"),
                hash=raw["hash"].lower(),
                models=tuple(models) if models is not None else None,
                created=0.0,
                expires=raw.get("expires"),
            )
        )
    if problems:
        raise StaticConfigError("invalid static file:\n" + "\n".join(f"  - {p}" for p in problems))
    auth = data.get("auth")
    return StaticConfig(
        catalog=Catalog(models=tuple(profiles)),
        routing=RoutingEndpoints(version=0, endpoints=endpoints),
        keys=tuple(keys),
        auth=bool(keys) if auth is None else bool(auth),
    )


def load_static(path: str) -> StaticConfig:
    try:
        with open(path, encoding="utf-8") as f:
            return parse_static(f.read())
    except OSError as e:
        raise StaticConfigError(f"cannot read {path}: {e.strerror}") from None
