"""The shipped rules and dashboard as promtool reads them, and the test's own rewrite of the rules.

Fast: no Prometheus runs here (test_alerts_e2e.py runs one); promtool parses every rule file and every
dashboard query (as recording rules: promtool has no other way to parse a lone expression)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import yaml

from tests.alerts.dashboard import dashboards, panels, queries
from tests.alerts.promstack import PROMTOOL, WHY_MISSING, Rewrite, rule_files, rules_for_test

needs_promtool = pytest.mark.skipif(PROMTOOL is None, reason=WHY_MISSING)


def promtool_check(path: Path) -> subprocess.CompletedProcess[str]:
    assert PROMTOOL is not None
    return subprocess.run([PROMTOOL, "check", "rules", str(path)], capture_output=True, text=True, timeout=60)


def test_there_are_rules_and_a_dashboard() -> None:
    assert rule_files(), "no rule file in deploy/prometheus/"
    assert dashboards(), "no dashboard in deploy/grafana/"


@needs_promtool
@pytest.mark.parametrize("path", rule_files(), ids=lambda p: p.name)
def test_promtool_passes_the_shipped_rules(path: Path) -> None:
    done = promtool_check(path)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "SUCCESS" in done.stdout


@needs_promtool
def test_promtool_refuses_a_rule_that_does_not_parse(tmp_path: Path) -> None:
    """The check above can fail: a broken expression is refused, and said so."""
    bad = tmp_path / "bad.yml"
    bad.write_text(
        yaml.safe_dump({"groups": [{"name": "g", "rules": [{"alert": "A", "expr": "sum by (x (y)"}]}]})
    )
    done = promtool_check(bad)
    assert done.returncode != 0
    assert "bad.yml" in done.stdout + done.stderr


@needs_promtool
@pytest.mark.parametrize("path", rule_files(), ids=lambda p: p.name)
def test_the_rules_as_the_e2e_test_rewrites_them_still_pass_promtool(path: Path, tmp_path: Path) -> None:
    out = tmp_path / path.name
    out.write_text(rules_for_test(path.read_text()))
    done = promtool_check(out)
    assert done.returncode == 0, done.stdout + done.stderr


def test_the_rewrite_changes_durations_and_named_thresholds_only() -> None:
    shipped = """\
groups:
  - name: g
    rules:
      - alert: LlmgwRequestsHeldLong
        expr: histogram_quantile(0.9, sum by (le) (rate(h_bucket[5m]))) > 30
        for: 5m
      - alert: LlmgwWebhookBacklog
        expr: max(x) > 300
      - alert: Other
        expr: (a unless a offset 10m) or increase(a[1h]) > 30
        for: 1m
"""
    got = {r["alert"]: r for r in yaml.safe_load(rules_for_test(shipped))["groups"][0]["rules"]}
    assert got["LlmgwRequestsHeldLong"] == {
        "alert": "LlmgwRequestsHeldLong",
        "expr": "histogram_quantile(0.9, sum by (le) (rate(h_bucket[20s]))) > 5",
        "for": "2s",
    }
    assert got["LlmgwWebhookBacklog"]["expr"] == "max(x) > 3"
    # Another rule's "> 30" is its own: only the named rules' thresholds change.
    assert got["Other"]["expr"] == "(a unless a offset 20s) or increase(a[20s]) > 30"
    assert got["Other"]["for"] == "2s"


def test_the_rewrite_fails_loudly_when_a_rewritten_threshold_changed() -> None:
    shipped = "groups: [{name: g, rules: [{alert: LlmgwWebhookBacklog, expr: 'max(x) > 600'}]}]"
    with pytest.raises(AssertionError, match="LlmgwWebhookBacklog"):
        rules_for_test(shipped, Rewrite())


@pytest.mark.parametrize("path", dashboards(), ids=lambda p: p.name)
def test_the_dashboard_is_whole(path: Path) -> None:
    doc = json.loads(path.read_text())
    assert doc["uid"] and doc["title"]
    names = {v["name"] for v in doc["templating"]["list"]}
    assert {"datasource", "model"} <= names
    seen_ids: set[int] = set()
    for p in panels(doc):
        assert p["id"] not in seen_ids, f"panel id {p['id']} twice"
        seen_ids.add(p["id"])
        if p["type"] == "row":
            continue
        assert p["datasource"]["uid"] == "${datasource}", p["title"]
        assert p["targets"], f"{p['title']}: no query"
        for t in p["targets"]:
            assert t["datasource"]["uid"] == "${datasource}", p["title"]
    titles = " ".join(p["title"].lower() for p in panels(doc))
    # What the issue asks the dashboard to show.
    for topic in (
        "capacity",
        "replicas by phase",
        "requests",
        "ttft",
        "hold",
        "migration",
        "tenancy",
        "refused",
    ):
        assert topic in titles, f"no panel about {topic}"


@needs_promtool
@pytest.mark.parametrize("path", dashboards(), ids=lambda p: p.name)
def test_promtool_parses_every_dashboard_query(path: Path, tmp_path: Path) -> None:
    qs = queries(path)
    assert qs
    rules = [{"record": f"dashboard:query_{i}", "expr": expr} for i, (_, expr) in enumerate(qs)]
    out = tmp_path / "dashboard-queries.yml"
    out.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    done = promtool_check(out)
    assert done.returncode == 0, done.stdout + done.stderr
