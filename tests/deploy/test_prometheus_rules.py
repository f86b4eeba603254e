"""deploy/prometheus/llmgw-rules.yml against what the services export and what the runbook says.

Metric names are collected from each service's own registry, built in this process the way the service
builds it: a rule naming a metric no service exports would never fire, and no test would notice."""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import pytest
import yaml
from nats.js.kv import KeyValue
from prometheus_client import CollectorRegistry

from llmgw_common import event_details
from llmgw_controlplane.metrics import ControlPlaneMetrics
from llmgw_controlplane.pass_requests import PassRequests
from llmgw_controlplane.pass_verdicts import Verdicts
from llmgw_controlplane.scheduler.event_detection import EventDetector
from llmgw_controlplane.scheduler.snapshot import Snapshot
from llmgw_notifier.metrics import NotifierMetrics
from llmgw_notifier.stats import NotifierStats
from llmgw_router.metrics import RouterMetrics
from llmgw_router.routing.endpoints import Pool
from llmgw_router.tenancy.ledger import Ledger
from llmgw_router.tenancy.ledgermetrics import LedgerMetrics
from llmgw_router.tenancy.usage import UsageTable
from llmgw_runtime.runtime import PassGuard

ROOT = Path(__file__).resolve().parents[2]
RULES = ROOT / "deploy" / "prometheus" / "llmgw-rules.yml"
RUNBOOK = ROOT / "docs" / "runbook.md"

# Series Prometheus makes itself for every target.
PROMETHEUS_OWN = {"up", "scrape_duration_seconds", "scrape_samples_scraped"}
# Event kinds that report, not alert: recoveries resolve an alert, scaling is the system working.
INFORMATIONAL = {
    "model.scaled_to_zero",
    "model.woken",
    "model.evicted",
    "model.scaled_up",
    "model.scaled_down",
}
_SUFFIXES = {
    "counter": ("_total",),
    "histogram": ("_bucket", "_sum", "_count"),
    "summary": ("", "_sum", "_count"),
}


@dataclass
class _Leader:
    """A leading control plane's parts, as the metrics read them (real objects, empty tables)."""

    leader: bool = True
    fence: int = 1
    passes: int = 0
    guard: PassGuard = field(default_factory=lambda: PassGuard("reconcile", logging.getLogger(__name__)))
    verdicts: Verdicts = field(default_factory=Verdicts)
    detector: EventDetector = field(default_factory=lambda: EventDetector(60.0))
    pass_requests: PassRequests = field(default_factory=PassRequests)

    def snapshot(self) -> Snapshot:
        return Snapshot(now=0.0, nodes={})


def exported(registry: CollectorRegistry) -> set[str]:
    """The sample names ``registry`` exports, from its families' names and types (samples or none)."""
    out: set[str] = set()
    for family in registry.collect():
        out.update(family.name + s for s in _SUFFIXES.get(family.type, ("",)))
    return out


def all_exported() -> set[str]:
    router = RouterMetrics(Pool(), {})
    # The router's recorded families appear once something is recorded.
    router.request("m", 200, 0.1)
    router.first_byte("m", 0.1)
    router.hold("m", 0.1)
    router.retry("m")
    router.migration("m", "failed")
    # The usage ledger's figures exist once a router has its ledger (reached the bus).
    table = UsageTable(since=0.0)
    ledger = Ledger(table, cast(KeyValue, None), "r", lambda: True, lambda: 0.0)
    router.registry.register(LedgerMetrics(lambda: ledger))
    registries = (
        ControlPlaneMetrics(_Leader()).registry,
        NotifierMetrics(NotifierStats(), lambda: {}).registry,
        router.registry,
    )
    return set().union(*(exported(r) for r in registries))


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression reads: its identifiers, less functions, keywords, label
    names (in matchers and in by/on/... lists), strings and durations."""
    e = re.sub(r'"(?:[^"\\]|\\.)*"', "", expr)
    e = re.sub(r"\{[^}]*\}", "", e)
    e = re.sub(r"\[[^\]]*\]", "", e)
    e = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", "", e)
    keywords = {"and", "or", "unless", "bool", "offset", "by", "without", "on", "ignoring"}
    names = set()
    for m in re.finditer(r"(?<![\w:.])[a-zA-Z_:][\w:]*", e):
        if not e[m.end() :].lstrip().startswith("("):  # a function or an aggregation
            names.add(m.group())
    return names - keywords


def rules() -> list[dict[str, Any]]:
    doc = yaml.safe_load(RULES.read_text())
    return [r for g in doc["groups"] for r in g["rules"]]


def slug(heading: str) -> str:
    """A Markdown heading's anchor, as GitHub makes it."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def runbook_sections() -> dict[str, str]:
    """Anchor -> text of each ``##`` section of the runbook."""
    out: dict[str, str] = {}
    for part in re.split(r"^## ", RUNBOOK.read_text(), flags=re.M)[1:]:
        heading, _, body = part.partition("\n")
        out[slug(heading)] = body
    return out


def test_the_name_extraction_sees_what_it_must() -> None:
    expr = 'histogram_quantile(0.9, sum by (model, le) (rate(a_bucket{x="y z"}[5m]))) > 30 and on(job) b == 1'
    assert metric_names(expr) == {"a_bucket", "b"}


@pytest.mark.parametrize("rule", rules(), ids=lambda r: str(r["alert"]))
def test_every_rule_reads_metrics_the_services_export(rule: dict[str, Any]) -> None:
    names = metric_names(rule["expr"])
    assert names, f"{rule['alert']}: no metric in {rule['expr']!r}"
    unknown = names - all_exported() - PROMETHEUS_OWN
    assert not unknown, f"{rule['alert']} reads {sorted(unknown)}, which no llmgw service exports"


def test_every_rule_names_its_runbook_section_and_the_section_names_it() -> None:
    sections = runbook_sections()
    for rule in rules():
        name, where = rule["alert"], rule["annotations"]["runbook"]
        path, _, anchor = where.partition("#")
        assert path == "docs/runbook.md", f"{name}: runbook annotation {where!r}"
        assert anchor in sections, f"{name}: the runbook has no section #{anchor}"
        assert f"`{name}`" in sections[anchor], f"runbook section #{anchor} does not link rule {name}"


def test_every_rule_the_runbook_links_exists() -> None:
    names = {r["alert"] for r in rules()}
    linked = set(re.findall(r"`(Llmgw\w+)`", RUNBOOK.read_text()))
    assert linked - names == set(), f"the runbook links rules the file lacks: {sorted(linked - names)}"


def test_every_alerting_event_of_the_runbook_has_a_rule() -> None:
    kinds = {
        kind
        for cls in vars(event_details).values()
        if isinstance(cls, type) and isinstance(kind := getattr(cls, "KIND", None), str)
    }
    named = set(re.findall(r"`([a-z]+\.[a-z_]+)`", RUNBOOK.read_text())) & kinds
    alerting = {k for k in named if not k.endswith(".recovered")} - INFORMATIONAL
    assert {"node.lost", "model.down", "placement.failing"} <= alerting  # the parse sees them
    covered = {r["labels"].get("event") for r in rules()}
    assert alerting - covered == set(), f"runbook alerts without a rule: {sorted(alerting - covered)}"


def test_every_rule_is_complete() -> None:
    seen: set[str] = set()
    for rule in rules():
        name = rule["alert"]
        assert name not in seen, f"{name} twice"
        seen.add(name)
        assert rule["labels"]["severity"] in ("warning", "critical"), name
        assert rule["annotations"]["summary"], name
