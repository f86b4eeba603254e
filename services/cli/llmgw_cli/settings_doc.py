"""Renders docs/configuration.md from the settings classes, so the reference cannot drift.

Regenerate with ``python -m llmgw_cli.settings_doc > docs/configuration.md``; a test fails when the
file and the classes disagree.
"""

from __future__ import annotations

import json

from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

from llmgw_agent.settings import AgentSettings
from llmgw_controlplane.settings import ControlPlaneSettings
from llmgw_notifier.settings import NotifierSettings
from llmgw_router.settings import RouterSettings
from llmgw_runtime.settings import BusSettings

SECTIONS: tuple[tuple[str, type[BusSettings], str], ...] = (
    ("Every process (bus)", BusSettings, "All commands read these."),
    ("Control plane", ControlPlaneSettings, "`llmgw controlplane`"),
    ("Router", RouterSettings, "`llmgw router`"),
    ("Agent", AgentSettings, "`llmgw agent`"),
    ("Notifier", NotifierSettings, "`llmgw notifier`"),
)

# Defaults computed on the machine (hostname, pid) are shown by what they mean.
_DYNAMIC = {"node": "the host name", "router_id": "r-<host>-<pid>"}


def _default(name: str, f: FieldInfo) -> str:
    if name in _DYNAMIC:
        return _DYNAMIC[name]
    if f.default_factory is not None:
        value = f.default_factory()  # type: ignore[call-arg]
    elif f.default is PydanticUndefined:
        return "(required)"
    else:
        value = f.default
    return "" if value is None else f"`{json.dumps(value)}`"


def render() -> str:
    out = [
        "# Configuration reference",
        "",
        "Generated from the settings classes (`llmgw_runtime/settings.py` and each service's `settings.py`) by "
        "`python -m llmgw_cli.settings_doc`; do not edit.",
        "",
        "Every setting is read from the environment as `LLMGW_<NAME>` (upper case), or from a YAML file",
        "named by `--config FILE` or `LLMGW_CONFIG` (keys as below, lower case). Command-line options win",
        "over the environment, which wins over the file. Lists take a comma-separated string in the",
        'environment; mappings take JSON (`LLMGW_LABELS=\'{"role": "coding"}\'`).',
        "",
        "Cluster-wide settings that change at run time (webhooks) are not here: they live in the bus",
        "(`llmgw_desired` key `settings`) and are set with `llmgw setup --webhook URL`.",
        "",
    ]
    seen: set[str] = set()
    for title, cls, used_by in SECTIONS:
        out += [
            f"## {title}",
            "",
            used_by,
            "",
            "| setting | env | default | meaning |",
            "| --- | --- | --- | --- |",
        ]
        for name, f in cls.model_fields.items():
            if cls is not BusSettings and name in seen:
                continue
            seen.add(name)
            desc = (f.description or "").replace("|", "\\|")
            default = _default(name, f).replace("|", "\\|")
            out.append(f"| `{name}` | `LLMGW_{name.upper()}` | {default} | {desc} |")
        out.append("")
    return "\n".join(out)


if __name__ == "__main__":
    print(render(), end="")
