"""``llmgw setup``: write the cluster settings, asking where a flag was not given.

Three things, each optional:

- a settings file for the processes on this machine (NATS address, prefix, fabric): ``--out``;
- the cluster's webhooks, stored in the bus (``llmgw_desired`` key ``settings``), where the notifier and
  the control plane pick them up without a restart;
- with ``--nats-auth``, a nats-server authorization block with one user per role and a settings file
  per role holding its credentials (``--creds-dir``).
"""

from __future__ import annotations

import asyncio
import os
import sys
from pathlib import Path
from typing import Annotated

import nats
import nats.errors
import nats.js.errors
import typer
import yaml

from llmgw_common.codec import DecodeError, decode, encode
from llmgw_common.messages import ClusterSettings, Webhook
from llmgw_common.natsauth import all_roles, authorization_config, role_credentials
from llmgw_common.subjects import DESIRED_SETTINGS, Subjects
from llmgw_common.urls import http_url_problem, shown_url
from llmgw_runtime import bus
from llmgw_runtime.settings import BusSettings

EMPTY_WEBHOOK_MEANS = (
    "An empty answer means no webhook: nobody will be told when a node or a watched model goes down "
    "(`llmgw ctl status` and the console will keep warning). Set one later with `llmgw setup --webhook URL`."
)


def _fail(message: str) -> None:
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(1)


async def store_webhooks(s: BusSettings, webhooks: list[Webhook], replace: bool) -> ClusterSettings:
    """Add (or, with ``replace``, set) the cluster's webhooks in ``llmgw_desired``, compare-and-set."""
    nc = await bus.connect(s, "llmgw-setup", wait=False)
    try:
        subj = Subjects(s.prefix)
        kv = await bus.ensure_kv(nc.jetstream(), subj.bucket_desired, history=5, replicas=s.kv_replicas)
        for _ in range(5):
            try:
                entry = await kv.get(DESIRED_SETTINGS)
                current = decode(entry.value or b"", ClusterSettings)
                revision = entry.revision or 0
            except nats.js.errors.NotFoundError:  # absent or deleted
                current, revision = ClusterSettings(), 0
            except DecodeError:
                # A broken value is replaced rather than merged into.
                current, revision = ClusterSettings(), (await kv.get(DESIRED_SETTINGS)).revision or 0
            kept = (
                ()
                if replace
                else tuple(w for w in current.webhooks if w.url not in {h.url for h in webhooks})
            )
            new = current.model_copy(update={"webhooks": (*kept, *webhooks)})
            try:
                if revision:
                    await kv.update(DESIRED_SETTINGS, encode(new), last=revision)
                else:
                    await kv.create(DESIRED_SETTINGS, encode(new))
                return new
            except nats.js.errors.KeyWrongLastSequenceError:  # also what create() raises when taken
                continue
        raise RuntimeError("the cluster settings kept changing under us; try again")
    finally:
        await nc.close()


def register(app: typer.Typer) -> None:
    @app.command("setup")
    def setup(
        nats_url: Annotated[list[str] | None, typer.Option("--nats", help="NATS URL (repeatable)")] = None,
        prefix: Annotated[str | None, typer.Option(help="Subject and bucket prefix")] = None,
        fabric: Annotated[str | None, typer.Option(help="Fabric of the nodes on this machine")] = None,
        out: Annotated[
            Path | None, typer.Option(help="Write a settings file for this machine's processes")
        ] = None,
        webhook: Annotated[str | None, typer.Option(help="Webhook URL to notify ('' for none)")] = None,
        webhook_format: Annotated[str, typer.Option(help="slack or json")] = "slack",
        webhook_secret: Annotated[str | None, typer.Option(help="HMAC secret for json webhooks")] = None,
        replace_webhooks: Annotated[bool, typer.Option(help="Replace the existing webhooks")] = False,
        nats_auth: Annotated[
            Path | None, typer.Option(help="Write a nats-server authorization block here")
        ] = None,
        nodes: Annotated[
            str | None, typer.Option(help="Comma-separated node names (agents) for --nats-auth")
        ] = None,
        creds_dir: Annotated[Path, typer.Option(help="Where per-role settings files go")] = Path(
            "llmgw-creds"
        ),
        no_input: Annotated[
            bool, typer.Option("--no-input", help="Never ask; use flags and defaults")
        ] = False,
    ) -> None:
        """Write the cluster settings: NATS address, fabric, webhooks, and per-role NATS credentials."""
        interactive = not no_input and sys.stdin.isatty()
        base = BusSettings()
        urls = nats_url or base.nats_urls
        if interactive and not nats_url:
            urls = [
                u.strip()
                for u in typer.prompt("NATS URL(s), comma-separated", default=",".join(urls)).split(",")
            ]
        pfx = prefix or base.prefix
        if interactive and fabric is None:
            fabric = (
                typer.prompt("Fabric of this machine's nodes (empty: none)", default="", show_default=False)
                or None
            )
        if interactive and webhook is None:
            typer.echo(EMPTY_WEBHOOK_MEANS)
            webhook = typer.prompt(
                "Webhook URL for alerts (Slack or generic)", default="", show_default=False
            )
            if webhook:
                webhook_format = typer.prompt("Format (slack or json)", default=webhook_format)
        if webhook and (problem := http_url_problem(webhook)) is not None:
            _fail(f"the webhook URL {problem}")  # not echoed: a Slack URL is a credential
        if webhook_format not in ("slack", "json"):
            _fail(f"webhook format {webhook_format!r} is neither slack nor json")
        try:
            settings = BusSettings(nats_urls=urls, prefix=pfx)
        except ValueError as e:
            _fail(str(e))

        if out is not None:
            data: dict[str, object] = {"nats_urls": urls, "prefix": pfx}
            if fabric:
                data["fabric"] = fabric
            out.write_text(yaml.safe_dump(data, sort_keys=False))
            typer.echo(f"wrote {out} (use it with --config {out} or LLMGW_CONFIG={out})")

        if nats_auth is not None:
            node_list = [n.strip() for n in (nodes or "").split(",") if n.strip()]
            try:
                roles = all_roles(Subjects(pfx), node_list)
            except ValueError as e:
                _fail(str(e))
            nats_auth.write_text(authorization_config(roles))
            creds_dir.mkdir(parents=True, exist_ok=True)
            for role in roles:
                path = creds_dir / f"{role.user}.yaml"
                path.write_text(yaml.safe_dump(role_credentials(role, urls, pfx), sort_keys=False))
                os.chmod(path, 0o600)
            os.chmod(nats_auth, 0o600)
            typer.echo(f"wrote {nats_auth} ({len(roles)} users) and per-role settings in {creds_dir}/")
            if not node_list:
                # The deploy configs include this file: without agent users every agent is refused.
                typer.echo(
                    "warning: no --nodes: the file has no agent users, so no agent can connect; "
                    "run it again with --nodes <every node>",
                    err=True,
                )

        if webhook:
            hook = Webhook(url=webhook, format=webhook_format, secret=webhook_secret)
            try:
                stored = asyncio.run(store_webhooks(settings, [hook], replace_webhooks))
            except (OSError, nats.errors.Error, TimeoutError) as e:
                _fail(f"cannot store the webhook: NATS at {', '.join(urls)} did not answer ({e})")
            except RuntimeError as e:
                _fail(str(e))
            # A Slack webhook URL is a credential: show only its host.
            typer.echo(f"webhooks now: {', '.join(shown_url(w.url) for w in stored.webhooks)}")
        elif webhook == "" or (webhook is None and not interactive):
            typer.echo("no webhook given. " + EMPTY_WEBHOOK_MEANS)
