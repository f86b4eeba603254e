"""Process settings: environment ``LLMGW_*`` over an optional YAML file over defaults.

The bus settings every process shares (:class:`BusSettings`) and how they are read; each service
keeps its own class beside its code (``llmgw_router.settings`` and so on). The YAML file is named
by ``LLMGW_CONFIG`` (or the ``--config`` option of each command); its top level holds the same field
names as the environment without the prefix, e.g. ``nats_urls: [nats://10.0.0.1:4222]``.
Nested fields use ``__`` in the environment: ``LLMGW_LABELS__role=coding``.

Cluster-wide settings that can change at run time (webhooks) live in the bus instead, in
``llmgw_desired`` key ``settings``: see :class:`llmgw_common.messages.ClusterSettings`.
"""

from __future__ import annotations

import os
from importlib.resources.abc import Traversable
from pathlib import Path
from typing import Annotated, Any, TypeVar

import yaml
from pydantic import Field, ValidationError, field_validator
from pydantic_settings import (
    BaseSettings,
    NoDecode,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    YamlConfigSettingsSource,
)

from llmgw_common.yamlsafe import load_yaml

S = TypeVar("S", bound="BusSettings")


class _BoundedYamlSource(YamlConfigSettingsSource):
    """pydantic-settings' YAML source, reading through :func:`load_yaml` (size and alias limits)."""

    def _read_file(self, file_path: Path | Traversable) -> dict[str, Any]:
        with file_path.open(encoding=self.yaml_file_encoding or "utf-8") as f:
            data = load_yaml(f)
        return data or {}


class BusSettings(BaseSettings):
    """How to reach NATS. Shared by every process."""

    model_config = SettingsConfigDict(env_prefix="LLMGW_", env_nested_delimiter="__", extra="ignore")

    # NoDecode: a comma-separated string in the environment, split by the validator below.
    nats_urls: Annotated[list[str], NoDecode] = Field(
        default=["nats://127.0.0.1:4222"], description="NATS servers to connect to"
    )
    prefix: str = Field(
        default="llmgw", description="Subject and bucket prefix (two clusters can share a NATS)"
    )
    nats_user: str | None = Field(default=None, description="NATS user name")
    nats_password: str | None = Field(default=None, description="NATS password")
    nats_creds: str | None = Field(default=None, description="Path of a NATS .creds file")
    nats_token: str | None = Field(default=None, description="NATS token")
    nats_tls_ca: str | None = Field(
        default=None, description="CA bundle that signs the NATS servers' certificates"
    )
    nats_tls_cert: str | None = Field(default=None, description="Client certificate for NATS mutual TLS")
    nats_tls_key: str | None = Field(default=None, description="Client key for NATS mutual TLS")
    nats_inbox_prefix: str | None = Field(
        default=None, description="Reply inbox prefix (for per-role permissions)"
    )
    kv_replicas: int = Field(
        default=1, ge=1, le=5, description="Replicas of buckets and streams (3 on a cluster)"
    )
    log_level: str = Field(default="INFO", description="Python log level")

    @field_validator("nats_urls", mode="before")
    @classmethod
    def _split_urls(cls, v: Any) -> Any:
        if isinstance(v, str):
            return [u.strip() for u in v.split(",") if u.strip()]
        return v

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        sources: list[PydanticBaseSettingsSource] = [init_settings, env_settings]
        path = os.environ.get("LLMGW_CONFIG")
        if path:
            sources.append(_BoundedYamlSource(settings_cls, yaml_file=path))
        return tuple(sources)


def load_settings(cls: type[S], config: str | None = None, **overrides: Any) -> S:
    """Settings of ``cls`` from env and YAML (``config`` or ``LLMGW_CONFIG``), then ``overrides``."""
    if config:
        os.environ["LLMGW_CONFIG"] = config
    try:
        return cls(**{k: v for k, v in overrides.items() if v is not None})
    except yaml.YAMLError as e:
        # As a ValidationError, so every command reports it as the bad settings it is (exit 2), not
        # with a traceback.
        where = os.environ.get("LLMGW_CONFIG", "settings file")
        raise ValidationError.from_exception_data(
            cls.__name__,
            [
                {
                    "type": "value_error",
                    "loc": (where,),
                    "input": None,
                    "ctx": {"error": f"not valid YAML: {e}"},
                }
            ],
        ) from None
