"""The CLI is a client: it imports a service package only in the command that starts that service.

Contracts the CLI shares with services (API keys, webhook URLs in logs, the simulated-GPU spec) live
in llmgw_common; a CLI module that imported a service for one of them would load the whole service
(and tie the client to its internals).
"""

from __future__ import annotations

import ast
from pathlib import Path

import llmgw_cli

SERVICES = ("llmgw_router", "llmgw_agent", "llmgw_notifier", "llmgw_controlplane", "llmgw_sim")
# The one service each entry point may import: the one it starts.
STARTS = {
    "cmd_router": "llmgw_router",
    "cmd_agent": "llmgw_agent",
    "cmd_notifier": "llmgw_notifier",
    "cmd_controlplane": "llmgw_controlplane",
    "cmd_sim_engine": "llmgw_sim",
}


def service_imports(source: str) -> set[str]:
    """The service packages a module's source imports, at any depth (lazy imports count)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        names = (
            [a.name for a in node.names]
            if isinstance(node, ast.Import)
            else [node.module or ""]
            if isinstance(node, ast.ImportFrom)
            else []
        )
        found.update(n.split(".")[0] for n in names if n.split(".")[0] in SERVICES)
    return found


def test_service_imports_sees_lazy_and_dotted_imports() -> None:
    src = "def f():\n    from llmgw_router.keys import x\n    import llmgw_agent.sim_gpus\n"
    assert service_imports(src) == {"llmgw_router", "llmgw_agent"}


def test_cli_modules_import_a_service_only_to_start_it() -> None:
    root = Path(llmgw_cli.__file__).parent
    wrong = {
        p.stem: sorted(got)
        for p in sorted(root.glob("*.py"))
        if (got := service_imports(p.read_text(encoding="utf-8")) - {STARTS.get(p.stem)})
    }
    assert wrong == {}
