"""The Grafana dashboard of deploy/grafana/ as the tests read it: every query, with Grafana's variables
given the values Grafana would give them (all models, a one-minute rate window)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tests.alerts.promstack import DASHBOARDS_DIR

# What Grafana puts in place of each variable the dashboard uses: every model, and a rate window of a
# minute (Grafana's own is four scrape intervals or more).
VARIABLES = {"$__rate_interval": "1m", "$model": ".*"}


def dashboards() -> list[Path]:
    return sorted(DASHBOARDS_DIR.glob("*.json"))


def panels(doc: dict[str, Any]) -> list[dict[str, Any]]:
    """Every panel, those inside collapsed rows included."""
    out: list[dict[str, Any]] = []
    for p in doc["panels"]:
        out.append(p)
        out.extend(p.get("panels", []))
    return out


def queries(path: Path) -> list[tuple[str, str]]:
    """(panel title / refId, PromQL with the variables filled in) of every query of the dashboard."""
    doc = json.loads(path.read_text())
    out = []
    for p in panels(doc):
        for t in p.get("targets", []):
            expr = str(t["expr"])
            for var, value in VARIABLES.items():
                expr = expr.replace(var, value)
            out.append((f"{p['title']} / {t['refId']}", expr))
    return out
