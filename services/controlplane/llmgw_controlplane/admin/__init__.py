"""The control plane's admin listener: the read-only console and ``/debug/stats``.

The pages are rendered from the same ctl views ``llmgw ctl`` prints (``views.py`` through
:class:`CtlApi`), so the console cannot disagree with the CLI. Nothing here writes: every route is
GET, and the app has no handle on anything that could mint a key or change desired state.

The listener binds loopback unless told otherwise: the same port serves debug endpoints that can
expose the process's memory, and pages carry the fleet's layout. Binding elsewhere needs
``allow_public`` and logs a warning. On loopback, requests must also name a loopback host, so a web
page that rebinds its DNS name to 127.0.0.1 cannot read the console from an operator's browser.
Forwarded headers (``X-Forwarded-*``) are never consulted (ARCHITECTURE #12).
"""

from llmgw_controlplane.admin.app import CONSOLE_DIR, PAGES, REFRESH_S, RenderStats, build_admin_app
from llmgw_controlplane.admin.listener import AdminBindError, AdminServer, is_loopback, serve_admin
from llmgw_controlplane.admin.source import ConsoleSource, CtlApiSource, SourceUnavailable

__all__ = [
    "CONSOLE_DIR",
    "PAGES",
    "REFRESH_S",
    "AdminBindError",
    "AdminServer",
    "ConsoleSource",
    "CtlApiSource",
    "RenderStats",
    "SourceUnavailable",
    "build_admin_app",
    "is_loopback",
    "serve_admin",
]
