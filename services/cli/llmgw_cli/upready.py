"""`llmgw up` once its processes are started: until a chat completion goes through the router, then
how to use it, then keeping the run whole (:mod:`llmgw_cli.upkeep`) until it is stopped."""

from __future__ import annotations

import time

import httpx

from llmgw_cli.devcluster import Child, Layout, Supervisor, log_tail, write_state
from llmgw_cli.upkeep import supervise
from llmgw_cli.upopts import LOOPBACK, reach_host
from llmgw_cli.upterm import StopFlag, err, out
from llmgw_common.catalog import Catalog
from llmgw_runtime.natsserver import NatsServer

STATE_FILE = "up.json"


def served_models(client: httpx.Client, base: str, key: str) -> list[str]:
    """The models the router lists (the catalog in the bus, which may not be the file's); [] if none."""
    try:
        r = client.get(f"{base}/v1/models", headers={"Authorization": f"Bearer {key}"})
        if r.status_code == 200:
            return [str(m["id"]) for m in r.json()["data"]]
    except (httpx.HTTPError, ValueError, KeyError, TypeError):
        pass
    return []


def try_chat(client: httpx.Client, base: str, key: str, model: str) -> str | None:
    """None when a chat completion for ``model`` succeeds through the router, else why not."""
    try:
        r = client.post(
            f"{base}/v1/chat/completions",
            headers={"Authorization": f"Bearer {key}"},
            json={"model": model, "messages": [{"role": "user", "content": "ping"}], "max_tokens": 4},
        )
    except httpx.HTTPError as e:
        return f"router not answering ({type(e).__name__})"
    if r.status_code == 200:
        try:
            if r.json().get("choices"):
                return None
        except ValueError:
            pass
        return "200 without choices"
    try:
        msg = r.json()["error"]["message"]
    except (ValueError, KeyError, TypeError):
        msg = r.text[:200]
    return f"{r.status_code}: {msg}"


def report_dead(children: list[Child]) -> None:
    for c in children:
        err(
            f"error: {c.spec.name} exited with code {c.proc.returncode} during start; last lines of {c.log_path}:"
        )
        for line in log_tail(c.log_path, 20):
            err(f"  | {line}")


def usage_text(base: str, key: str, model: str, models: list[str], layout: Layout, ready_s: float) -> str:
    pre = "" if layout.prefix == "llmgw" else f" --prefix {layout.prefix}"
    bound = "" if reach_host(layout.host) == layout.host else f" (the router listens on {layout.host})"
    nats = "" if layout.nats_url == "nats://127.0.0.1:4222" else f" --nats {layout.nats_url}"
    console = (
        f"  console          http://{LOOPBACK}:{layout.controlplane_admin_port}/\n"
        if layout.controlplane_admin_port
        else ""
    )
    return f"""
llmgw is up: a chat completion went through the router {ready_s:.1f} s after start.

  OpenAI base URL  {base}/v1{bound}
  API key          {key}
                   (kept in {layout.data_dir / "dev-key"}; reused by the next run)
  models           {", ".join(models)}
{console}  NATS             {layout.nats_url} (prefix {layout.prefix})
  logs             {layout.logs_dir}/

Try it with curl:

curl {base}/v1/chat/completions \\
  -H "Authorization: Bearer {key}" \\
  -H "Content-Type: application/json" \\
  -d '{{"model": "{model}", "messages": [{{"role": "user", "content": "Hello!"}}]}}'

or with the openai package:

python - <<'EOF'
from openai import OpenAI
client = OpenAI(base_url="{base}/v1", api_key="{key}")
r = client.chat.completions.create(model="{model}", messages=[{{"role": "user", "content": "Hello!"}}])
print(r.choices[0].message.content)
EOF

Look around: llmgw ctl nodes{nats}{pre}   llmgw ctl replicas{nats}{pre}   llmgw ctl models{nats}{pre}
Ctrl-C stops everything.
"""


def wait_ready_then_serve(
    stop: StopFlag,
    t0: float,
    sup: Supervisor,
    nats: NatsServer | None,
    layout: Layout,
    catalog: Catalog,
    key: str,
    state: dict[str, object],
    ready_timeout_s: float,
) -> int:
    base = layout.router_url
    deadline = t0 + ready_timeout_s
    last: dict[str, str] = {}
    ready_model: str | None = None
    with httpx.Client(timeout=httpx.Timeout(5.0, connect=1.0)) as client:
        while ready_model is None:
            if stop.is_set:
                return 0
            dead = sup.dead()
            if dead:
                report_dead(dead)
                return 1
            if nats is not None and nats.proc is not None and nats.proc.poll() is not None:
                err(f"error: nats-server exited with code {nats.proc.returncode}; see {nats.log_file}")
                return 1
            if time.monotonic() > deadline:
                err(f"error: no chat completion succeeded within {ready_timeout_s:.0f} s; last answers:")
                for m, why in last.items():
                    err(f"  {m}: {why}")
                err(f"logs: {layout.logs_dir}/")
                return 1
            for m in served_models(client, base, key) or catalog.names:
                answer = try_chat(client, base, key, m)
                if answer is None:
                    ready_model = m
                    break
                last[m] = answer
            else:
                stop.wait(0.5)
        models = served_models(client, base, key) or list(catalog.names)
    ready_s = time.monotonic() - t0
    state.update(ready=True, ready_s=round(ready_s, 2), model=ready_model)
    write_state(layout.data_dir / STATE_FILE, state)
    out(usage_text(base, key, ready_model, models, layout, ready_s))
    # From here a child or the nats-server that dies is announced and restarted, with a backoff.
    return supervise(stop, sup, nats, state, state_path=layout.data_dir / STATE_FILE, say=err)
