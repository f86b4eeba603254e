"""The page at ``/``: how to connect, and nothing else (ARCHITECTURE #12).

It is served without a key, so it carries no data: no model names, replicas, nodes or counts. The base
URL shown is rebuilt from ``X-Forwarded-Proto``/``-Host``/``-Prefix`` for display only, and only when
they come from a proxy in ``trusted_proxies`` (``http.request.Request.headers`` leaves them out for anyone else:
a client's own would make the page say "send your key to attacker.example", and it is sent with
``Cache-Control: no-store`` so no shared cache keeps it for others); values that do not look like a
scheme, a host or a path are ignored rather than echoed, and everything is HTML-escaped (the examples
are meant to be copied into a shell).
"""

from __future__ import annotations

import html
import re
from collections.abc import Mapping

_HOST = re.compile(r"^[A-Za-z0-9.\-]+(:\d{1,5})?$|^\[[0-9A-Fa-f:.]+\](:\d{1,5})?$")
_PREFIX = re.compile(r"^(/[A-Za-z0-9._~\-]+)*/?$")


def _first(value: str | None) -> str | None:
    if not value:
        return None
    return value.split(",")[0].strip() or None


def display_base_url(headers: Mapping[str, str], scheme: str, host: str) -> str:
    """The base URL a client would use, for display. Never used for any decision."""
    proto = _first(headers.get("X-Forwarded-Proto"))
    if proto not in ("http", "https"):
        proto = scheme if scheme in ("http", "https") else "http"
    fhost = _first(headers.get("X-Forwarded-Host"))
    if fhost is None or not _HOST.match(fhost):
        fhost = host if _HOST.match(host or "") else "localhost"
    prefix = _first(headers.get("X-Forwarded-Prefix")) or ""
    if not _PREFIX.match(prefix):
        prefix = ""
    return f"{proto}://{fhost}{prefix.rstrip('/')}/v1"


def render(base_url: str) -> str:
    b = html.escape(base_url, quote=True)
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>llmgw</title>
<style>body{{font-family:system-ui,sans-serif;max-width:46rem;margin:2rem auto;padding:0 1rem;line-height:1.5}}
pre{{background:#f4f4f4;padding:.8rem;overflow-x:auto}}code{{background:#f4f4f4}}</style></head>
<body>
<h1>llmgw</h1>
<p>This is an OpenAI-compatible API. Base URL: <code>{b}</code></p>
<p>Every request needs an API key (<code>Authorization: Bearer &lt;key&gt;</code>); ask the operator
of this cluster for one (<code>llmgw keys create --name you</code>). The models your key may use are
listed by <code>GET {b}/models</code>.</p>
<h2>curl</h2>
<pre>curl {b}/models -H "Authorization: Bearer $LLMGW_API_KEY"

curl {b}/chat/completions \\
  -H "Authorization: Bearer $LLMGW_API_KEY" -H "Content-Type: application/json" \\
  -d '{{"model": "MODEL", "messages": [{{"role": "user", "content": "Hello"}}]}}'</pre>
<h2>Python</h2>
<pre>from openai import OpenAI

client = OpenAI(base_url="{b}", api_key="YOUR_KEY")
print([m.id for m in client.models.list()])
reply = client.chat.completions.create(
    model="MODEL", messages=[{{"role": "user", "content": "Hello"}}]
)
print(reply.choices[0].message.content)</pre>
</body></html>
"""
