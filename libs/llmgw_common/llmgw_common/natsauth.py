"""Least privilege on the bus: one NATS user per role, with subject permissions.

``authorization_config()`` renders a nats-server ``authorization { users = [...] }`` block; each role's
client settings (user, password, inbox prefix) come from :func:`role_credentials`. Config-file users
cannot use permission templates, so every agent gets a block of its own (NATS-NOTES.md).

What each role may do:

- ``controlplane`` and ``admin`` (ctl, keys, setup): everything. Only they can write ``assign``,
  ``desired``, ``replicas``, ``keys``, ``routing``.
- ``agent-<node>``: publish its own ``node.<node>.*`` subjects (its KV-cache deltas ``node.<node>.kv``
  among them); read only its own assignment key; answer snapshot requests on its own
  ``node.<node>.kv-snapshot`` (``allow_responses``: a reply to the asker's inbox, nothing else there);
  write the ``tokenizers`` object store (any agent may: one model is served on many nodes).
- ``router``: publish its idle and usage reports and wake requests; read ``routing`` and ``keys``; hear load
  reports and every node's KV-cache deltas, ask any node for a KV snapshot; read the ``tokenizers``
  object store; write and read the ``usage`` ledger (a router writes only keys named for itself, by convention:
  NATS permissions cannot tell one router user from another).
- ``notifier``: consume the events stream and publish model events; read ``routing`` and ``desired``.

JetStream reads go through the ``$JS.API`` subjects, so a role that may read a bucket is granted the
stream-info, direct-get and (for watchers) consumer-create subjects of that bucket's stream only.
"""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass, field

from llmgw_common.subjects import Subjects, check_token

API = "$JS.API"


@dataclass(frozen=True)
class Role:
    user: str
    password: str
    inbox_prefix: str
    publish: tuple[str, ...] = ()
    subscribe: tuple[str, ...] = ()
    full: bool = False
    extra: dict[str, str] = field(default_factory=dict)
    # May publish one reply to the reply subject of each request it received (nats-server's
    # ``allow_responses``), whatever its publish list says.
    allow_responses: bool = False


def _kv_read(bucket: str, watch: bool = True) -> list[str]:
    stream = f"KV_{bucket}"
    subjects = [f"{API}.STREAM.INFO.{stream}", f"{API}.DIRECT.GET.{stream}", f"{API}.DIRECT.GET.{stream}.>"]
    if watch:
        subjects += [
            f"{API}.CONSUMER.CREATE.{stream}",
            f"{API}.CONSUMER.CREATE.{stream}.>",
            f"{API}.CONSUMER.DELETE.{stream}.>",
            f"{API}.CONSUMER.INFO.{stream}.>",
            f"{API}.STREAM.MSG.GET.{stream}",
        ]
    return subjects


def _obj_read(bucket: str) -> list[str]:
    """An object store's reads: its meta by last-message get, its chunks through an ordered consumer."""
    stream = f"OBJ_{bucket}"
    return [
        # nats-py's object get subscribes by subject, and first asks which stream holds it (names only).
        f"{API}.STREAM.NAMES",
        f"{API}.STREAM.INFO.{stream}",
        f"{API}.STREAM.MSG.GET.{stream}",
        f"{API}.DIRECT.GET.{stream}",
        f"{API}.DIRECT.GET.{stream}.>",
        f"{API}.CONSUMER.CREATE.{stream}",
        f"{API}.CONSUMER.CREATE.{stream}.>",
        f"{API}.CONSUMER.DELETE.{stream}.>",
        f"{API}.CONSUMER.INFO.{stream}.>",
    ]


def _obj_write(bucket: str) -> list[str]:
    """An object store's writes: made if missing (bind first), chunks and meta put, old chunks purged."""
    stream = f"OBJ_{bucket}"
    return [
        f"{API}.STREAM.CREATE.{stream}",
        f"{API}.STREAM.PURGE.{stream}",
        f"$O.{bucket}.C.>",
        f"$O.{bucket}.M.>",
    ]


def agent_role(subjects: Subjects, node: str, password: str) -> Role:
    check_token(node, "node")
    stream = f"KV_{subjects.bucket_assign}"
    inbox = f"_INBOX_{node}"
    return Role(
        user=f"agent-{node}",
        password=password,
        inbox_prefix=inbox,
        publish=(
            f"{subjects.prefix}.node.{node}.>",
            f"{API}.STREAM.INFO.{stream}",
            f"{API}.DIRECT.GET.{stream}.$KV.{subjects.bucket_assign}.{node}",
            *_obj_read(subjects.bucket_tokenizers),
            *_obj_write(subjects.bucket_tokenizers),
        ),
        subscribe=(f"{inbox}.>", subjects.inventory_request(node), subjects.kv_snapshot(node)),
        allow_responses=True,
    )


def _stream_info(subjects: Subjects) -> list[str]:
    """Metadata of every llmgw bucket and the events stream: services bind them all at start."""
    buckets = (
        subjects.bucket_assign,
        subjects.bucket_routing,
        subjects.bucket_desired,
        subjects.bucket_replicas,
        subjects.bucket_keys,
        subjects.bucket_leader,
        subjects.bucket_usage,
    )
    # A wildcard matches whole tokens only, so each stream is named.
    return [f"{API}.STREAM.INFO.KV_{b}" for b in buckets] + [f"{API}.STREAM.INFO.{subjects.events_stream}"]


def router_role(subjects: Subjects, password: str) -> Role:
    inbox = "_INBOX_router"
    return Role(
        user="router",
        password=password,
        inbox_prefix=inbox,
        publish=(
            f"{subjects.prefix}.router.*.idle",
            f"{subjects.prefix}.router.*.usage",
            f"{subjects.prefix}.router.*.demand",
            f"{subjects.prefix}.router.*.wake",
            *_kv_read(subjects.bucket_routing),
            *_kv_read(subjects.bucket_keys),
            # The durable usage ledger: its own hours written, the month's read at start (budgets).
            f"$KV.{subjects.bucket_usage}.>",
            *_kv_read(subjects.bucket_usage),
            *_stream_info(subjects),
            "$JS.FC.>",
            subjects.all_nodes("kv-snapshot"),
            *_obj_read(subjects.bucket_tokenizers),
        ),
        # Peers' usage reports: each router's quota share of a key's limits follows them (quota.py).
        subscribe=(
            f"{inbox}.>",
            subjects.all_nodes("load"),
            f"{subjects.prefix}.router.*.usage",
            subjects.all_nodes("kv"),
            # A control plane just started asks for whole demand reports (DemandWholeAsk).
            subjects.demand_whole(),
        ),
    )


def notifier_role(subjects: Subjects, password: str) -> Role:
    inbox = "_INBOX_notifier"
    stream = subjects.events_stream
    return Role(
        user="notifier",
        password=password,
        inbox_prefix=inbox,
        publish=(
            f"{subjects.prefix}.events.model.>",
            f"{API}.STREAM.INFO.{stream}",
            f"{API}.CONSUMER.CREATE.{stream}.>",
            f"{API}.CONSUMER.DURABLE.CREATE.{stream}.>",
            f"{API}.CONSUMER.INFO.{stream}.>",
            f"{API}.CONSUMER.MSG.NEXT.{stream}.>",
            f"$JS.ACK.{stream}.>",
            *_kv_read(subjects.bucket_routing),
            *_kv_read(subjects.bucket_desired),
            *_stream_info(subjects),
            "$JS.FC.>",
        ),
        subscribe=(f"{inbox}.>",),
    )


def full_role(user: str, password: str) -> Role:
    return Role(user=user, password=password, inbox_prefix="_INBOX", full=True)


def new_password() -> str:
    return secrets.token_urlsafe(24)


def all_roles(subjects: Subjects, nodes: list[str]) -> list[Role]:
    """Fresh credentials for every role: control plane, admin, router, notifier, one agent per node."""
    roles = [
        full_role("controlplane", new_password()),
        full_role("admin", new_password()),
        router_role(subjects, new_password()),
        notifier_role(subjects, new_password()),
    ]
    roles += [agent_role(subjects, n, new_password()) for n in nodes]
    return roles


def _q(s: str) -> str:
    return json.dumps(s)


def authorization_config(roles: list[Role]) -> str:
    """A nats-server ``authorization`` block for these roles (include it in each server's config)."""
    lines = ["authorization {", "  users = ["]
    for r in roles:
        if r.full:
            perms = 'publish: {allow: [">"]}, subscribe: {allow: [">"]}'
        else:
            pub = ", ".join(_q(s) for s in r.publish)
            sub = ", ".join(_q(s) for s in r.subscribe)
            perms = f"publish: {{allow: [{pub}]}}, subscribe: {{allow: [{sub}]}}"
            if r.allow_responses:
                perms += ", allow_responses: true"
        lines.append(f"    {{user: {_q(r.user)}, password: {_q(r.password)}, permissions: {{{perms}}}}}")
    lines += ["  ]", "}", ""]
    return "\n".join(lines)


def role_credentials(role: Role, nats_urls: list[str], prefix: str) -> dict[str, object]:
    """The settings a process of this role needs (a YAML file for ``--config``)."""
    return {
        "nats_urls": nats_urls,
        "prefix": prefix,
        "nats_user": role.user,
        "nats_password": role.password,
        "nats_inbox_prefix": role.inbox_prefix,
    }
