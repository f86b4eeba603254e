"""Process settings: environment ``LLMGW_*`` over an optional YAML file over defaults.

One class per service, all sharing the bus settings of :class:`BusSettings`. The YAML file is named
by ``LLMGW_CONFIG`` (or the ``--config`` option of each command); its top level holds the same field
names as the environment without the prefix, e.g. ``nats_urls: [nats://10.0.0.1:4222]``.
Nested fields use ``__`` in the environment: ``LLMGW_LABELS__role=coding``.

Cluster-wide settings that can change at run time (webhooks) live in the bus instead, in
``llmgw_desired`` key ``settings``: see :class:`llmgw_common.messages.ClusterSettings`.
"""

from __future__ import annotations

import os
import socket
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

from llmgw_common.names import as_token, check_token
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


class AgentSettings(BusSettings):
    node: str = Field(default_factory=socket.gethostname, description="Node id (a NATS subject token)")
    address: str = Field(default="127.0.0.1", description="Address routers use to reach this node's engines")
    fabric: str | None = Field(
        default=None, description="Network fabric (nodes of one multi-node replica share one)"
    )
    labels: dict[str, str] = Field(default_factory=dict, description="Node labels for node_selector")
    model_dirs: Annotated[list[str], NoDecode] = Field(
        default_factory=list, description="Directories scanned for model weights"
    )
    sim_gpus: str | None = Field(
        default=None, description="Simulated GPUs: '<count>x<CLASS>', e.g. '8xH100-80GB'"
    )
    sim_unhealthy: dict[int, str] = Field(
        default_factory=dict, description="Simulated unhealthy GPUs: index -> reason, e.g. {3: 'XID 79'}"
    )
    sim_memory_gb: float | None = Field(default=None, description="Simulated MemTotal (simulated nodes only)")
    simulate_engines: bool = Field(default=False, description="Run every engine as the simulator")
    gpu_class_overrides: dict[str, str] = Field(default_factory=dict, description="NVML name -> GPU class")
    port_range: str = Field(default="20000-29999", description="Ports for engines")
    state_dir: str = Field(default=".llmgw/agent", description="Where the agent keeps its engine state file")
    heartbeat_interval_s: float = Field(default=2.0, gt=0)
    load_interval_s: float = Field(default=1.0, gt=0)
    inventory_interval_s: float = Field(default=60.0, gt=0)
    stop_grace_s: float = Field(default=10.0, ge=0, description="SIGTERM to SIGKILL for engines")
    quiesce_s: float = Field(
        default=60.0,
        ge=0,
        description="Longest wait for an unassigned engine's requests in progress to finish before it is stopped",
    )
    llama_server: str = Field(default="llama-server", description="llama.cpp server binary")
    vllm: str = Field(default="vllm", description="vLLM binary")

    @field_validator("model_dirs", mode="before")
    @classmethod
    def _split_dirs(cls, v: Any) -> Any:
        if isinstance(v, str):
            return [d for d in v.replace(",", os.pathsep).split(os.pathsep) if d]
        return v


class ControlPlaneSettings(BusSettings):
    catalog_file: str | None = Field(
        default=None, description="Catalog loaded at start when the bus has none"
    )
    admin_host: str = Field(default="127.0.0.1", description="Admin listener (console, debug)")
    admin_port: int = Field(default=8081, description="Admin listener port (0: none)")
    allow_public_admin: bool = Field(
        default=False, description="Permit binding the admin listener off loopback"
    )
    tick_s: float = Field(default=1.0, gt=0, description="Reconcile interval")
    heartbeat_interval_s: float = Field(default=2.0, gt=0, description="Expected agent heartbeat interval")
    unreachable_after_missed: int = Field(default=3, ge=1, description="Missed heartbeats before unreachable")
    node_lost_s: float = Field(default=30.0, gt=0, description="Silence after which a node is lost")
    node_forget_s: float = Field(
        default=86400.0,
        gt=0,
        description="A lost node with no replica on it is removed from the node table after this long lost",
    )
    settle_s: float = Field(default=6.0, ge=0, description="Wait for agents to report after a start")
    lease_ttl_s: float = Field(default=10.0, gt=0, description="Leader lease TTL")
    drain_grace_s: float = Field(default=600.0, gt=0, description="Default drain grace period")
    placement_failing_after_s: float = Field(
        default=120.0, gt=0, description="Unplaceable for this long: event"
    )
    backoff_base_s: float = Field(default=5.0, gt=0, description="First crash-loop backoff")
    backoff_max_s: float = Field(default=300.0, gt=0, description="Crash-loop backoff cap")
    idle_threshold_s: float = Field(
        default=3600.0, gt=0, description="Unused for longer than this: shown as idle"
    )
    eviction_min_residency_s: float = Field(
        default=300.0,
        ge=0,
        description="A replica runs at least this long before it may be evicted to make room (no thrash)",
    )


class RouterSettings(BusSettings):
    # One subject token (its reports go to <prefix>.router.<id>.idle): a hostname's dots become dashes.
    router_id: str = Field(default_factory=lambda: f"r-{as_token(socket.gethostname())}-{os.getpid()}")
    host: str = Field(default="127.0.0.1", description="OpenAI listener address")
    port: int = Field(default=8080, description="OpenAI listener port")
    admin_host: str = Field(default="127.0.0.1", description="Admin listener (metrics)")
    admin_port: int = Field(default=0, description="Admin listener port (0: none)")
    auth: bool = Field(default=True, description="Require an API key")
    auth_exempt: Annotated[list[str], NoDecode] = Field(
        default=["/", "/health", "/healthz"], description="Paths served without a key"
    )

    @field_validator("router_id")
    @classmethod
    def _router_id_token(cls, v: str) -> str:
        return check_token(v, "router_id")

    @field_validator("auth_exempt", mode="before")
    @classmethod
    def _split_exempt(cls, v: Any) -> Any:
        if isinstance(v, str):
            return [p.strip() for p in v.split(",") if p.strip()]
        return v

    max_body_bytes: int = Field(default=8 * 1024 * 1024, gt=0, description="Largest request body")
    retries: int = Field(default=2, ge=0, description="Other endpoints tried before the first byte")
    max_migrations: int = Field(
        default=2,
        ge=0,
        description="Times one stream that broke after its first byte is continued on another replica",
    )
    connect_timeout_s: float = Field(default=5.0, gt=0)
    read_timeout_s: float = Field(default=600.0, gt=0)
    stream_stall_s: float = Field(
        default=60.0,
        gt=0,
        description="A stream silent this long after its first byte is broken: continued on another"
        " replica (capped by read_timeout_s, which bounds the wait for the first byte)",
    )
    load_stale_s: float = Field(default=5.0, gt=0, description="Ignore agents' load reports older than this")
    header_timeout_s: float = Field(
        default=10.0, gt=0, description="A client's request line and headers must arrive within this"
    )
    body_timeout_s: float = Field(
        default=60.0, gt=0, description="A request body must arrive within this of its headers (else 408)"
    )
    idle_timeout_s: float = Field(
        default=75.0, gt=0, description="Close a client's keep-alive connection idle for this long"
    )
    write_timeout_s: float = Field(
        default=60.0,
        gt=0,
        description="Close a client's connection when it has read nothing of its answer for this long",
    )
    max_connections: int = Field(
        default=8192,
        gt=0,
        description="Client connections held at most; beyond it idle ones are closed, else new ones refused",
    )
    tick_s: float = Field(default=1.0, gt=0)
    static_file: str | None = Field(default=None, description="Serve fixed endpoints from this file, no NATS")
    prefix_affinity: bool = Field(
        default=False, description="Send requests sharing a prompt prefix to the same replica (bounded load)"
    )
    prefix_load_factor: float = Field(
        default=1.25,
        ge=1.0,
        description="With prefix affinity, no replica takes more than this times its share of in-flight requests",
    )


class NotifierSettings(BusSettings):
    router_url: str = Field(default="http://127.0.0.1:8080", description="Router the probes go through")
    probe_key: str | None = Field(default=None, description="API key for probes")
    group_window_s: float = Field(
        default=10.0, ge=0, description="Events of one kind within this are grouped"
    )
    retry_for_s: float = Field(default=3600.0, gt=0, description="How long a delivery is retried")
    retry_base_s: float = Field(
        default=1.0, gt=0, description="First delivery retry delay (doubles, jittered)"
    )
    retry_max_s: float = Field(default=60.0, gt=0, description="Longest delay between delivery retries")
    http_timeout_s: float = Field(default=10.0, gt=0, description="One webhook request's time limit")
    ack_wait_s: float = Field(
        default=30.0, gt=0, description="Unconfirmed events come back this long after a notifier dies"
    )


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
