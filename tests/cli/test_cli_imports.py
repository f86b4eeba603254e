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
    src = "def f():\n    from llmgw_router.tenancy.keys import x\n    import llmgw_agent.sim_gpus\n"
    assert service_imports(src) == {"llmgw_router", "llmgw_agent"}


# The reference of every setting (docs/configuration.md) is written from each service's settings class,
# which lives beside that service's code: that module may import those, and nothing else of a service.
READS_SETTINGS = "settings_doc"


def settings_imports(source: str) -> set[str]:
    """The modules of service packages a module's source imports from, at any depth."""
    return {
        node.module
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in SERVICES
    }


def test_cli_modules_import_a_service_only_to_start_it() -> None:
    root = Path(llmgw_cli.__file__).parent
    wrong = {
        p.stem: sorted(got)
        for p in sorted(root.glob("*.py"))
        if p.stem != READS_SETTINGS
        and (got := service_imports(p.read_text(encoding="utf-8")) - {STARTS.get(p.stem)})
    }
    assert wrong == {}


def test_the_settings_reference_reads_only_the_services_settings() -> None:
    source = (Path(llmgw_cli.__file__).parent / f"{READS_SETTINGS}.py").read_text(encoding="utf-8")
    got = settings_imports(source)
    assert got == {f"{s}.settings" for s in SERVICES if s != "llmgw_sim"}
    assert settings_imports("from llmgw_router.proxy import forward\n") == {"llmgw_router.proxy"}
