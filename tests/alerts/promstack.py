"""Debian's Prometheus and Alertmanager as processes of a test: free ports, config and data in a temporary
directory, stopped with the test (never the packages' system services). ``make prometheus-deps``
installs them; :data:`MISSING` says which are absent, for a skip.

Also what the alert tests read of them: PromQL answers, the alerts Alertmanager holds (recorded over
time by :class:`AlertLog`, so an alert that fired for two seconds is not missed between two looks), and
the shipped rule file rewritten to test time (:func:`rules_for_test`).
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import shutil
import subprocess
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import yaml

from tests.kit.poll import eventually_sync
from tests.kit.ports import free_port

ROOT = Path(__file__).resolve().parents[2]
RULES_DIR = ROOT / "deploy" / "prometheus"
DASHBOARDS_DIR = ROOT / "deploy" / "grafana"

PROMETHEUS = shutil.which("prometheus")
PROMTOOL = shutil.which("promtool")
# Debian names the binary prometheus-alertmanager; upstream's tarball calls it alertmanager.
ALERTMANAGER = shutil.which("prometheus-alertmanager") or shutil.which("alertmanager")
MISSING = [
    name
    for name, path in (("prometheus", PROMETHEUS), ("promtool", PROMTOOL), ("alertmanager", ALERTMANAGER))
    if path is None
]
WHY_MISSING = f"{', '.join(MISSING)} not installed (`make prometheus-deps`)"

# Scrape and evaluate every second: an alert then fires within a few seconds of its condition.
INTERVAL_S = 1


def rule_files() -> list[Path]:
    return sorted(RULES_DIR.glob("*.yml"))


# ---------------------------------------------------------------- the rules at test time


@dataclass(frozen=True)
class Rewrite:
    """What the test changes in the shipped rules, so that a test of minutes can see them fire and
    resolve: every ``for:`` becomes :attr:`hold`, every range and offset becomes :attr:`window`, and the
    thresholds that are durations (seconds held, undelivered, unwritten) become shorter ones. The rest of
    each expression (metrics, labels, aggregation, functions) is the shipped text."""

    hold: str = "2s"
    window: str = "20s"
    # alert -> (the shipped comparison, the test's): asserted present, so a changed rule is noticed.
    thresholds: Mapping[str, tuple[str, str]] = field(
        default_factory=lambda: {
            "LlmgwRequestsHeldLong": ("> 30", "> 5"),
            "LlmgwWebhookBacklog": ("> 300", "> 3"),
            "LlmgwUsageLedgerBehind": ("> 120", "> 3"),
        }
    )


_RANGE = re.compile(r"\[(\d+[smhdwy])\]")
_OFFSET = re.compile(r"\boffset\s+(\d+[smhdwy])\b")


def rules_for_test(text: str, rewrite: Rewrite = Rewrite()) -> str:
    """The rule file ``text`` with :class:`Rewrite`'s changes."""
    doc = yaml.safe_load(text)
    for group in doc["groups"]:
        for rule in group["rules"]:
            expr = str(rule["expr"])
            expr = _RANGE.sub(f"[{rewrite.window}]", expr)
            expr = _OFFSET.sub(f"offset {rewrite.window}", expr)
            old_new = rewrite.thresholds.get(rule.get("alert", ""))
            if old_new is not None:
                old, new = old_new
                assert old in expr, f"{rule['alert']}: the test rewrites {old!r}, not in {expr!r}"
                expr = expr.replace(old, new)
            rule["expr"] = expr
            if "for" in rule:
                rule["for"] = rewrite.hold
    return str(yaml.safe_dump(doc, sort_keys=False))


# ---------------------------------------------------------------- the processes


@dataclass
class _Server:
    name: str
    argv: list[str]
    port: int
    log_path: Path
    popen: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        with open(self.log_path, "ab") as log:
            self.popen = subprocess.Popen(
                self.argv,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def wait_ready(self, timeout: float = 60.0) -> None:
        def ready() -> bool:
            assert self.popen is not None
            if self.popen.poll() is not None:
                raise AssertionError(f"{self.name} exited with {self.popen.returncode}:\n{self.tail()}")
            try:
                return httpx.get(self.url + "/-/ready", timeout=1).status_code == 200
            except httpx.HTTPError:
                return False

        eventually_sync(ready, timeout=timeout, every=0.1, what=f"{self.name} to be ready")

    def stop(self) -> None:
        if self.popen is None or self.popen.poll() is not None:
            return
        self.popen.terminate()
        try:
            self.popen.wait(10)
        except subprocess.TimeoutExpired:
            self.popen.kill()
            self.popen.wait()

    def tail(self, lines: int = 30) -> str:
        with contextlib.suppress(OSError):
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        return ""


@dataclass
class PromStack:
    """One Alertmanager and one Prometheus that sends it its alerts, scraping ``jobs`` (job -> targets
    ``host:port``) with the rule file at ``rules``."""

    root: Path
    jobs: Mapping[str, Sequence[str]]
    rules: Path
    servers: list[_Server] = field(default_factory=list)

    def __post_init__(self) -> None:
        assert PROMETHEUS and ALERTMANAGER, WHY_MISSING
        self.root.mkdir(parents=True, exist_ok=True)
        am_port, prom_port = free_port(), free_port()
        am_conf = self.root / "alertmanager.yml"
        am_conf.write_text(
            yaml.safe_dump(
                {
                    # A receiver that sends nothing: the test reads what Alertmanager holds from its API.
                    "route": {"receiver": "test", "group_wait": "0s", "group_interval": "1s"},
                    "receivers": [{"name": "test"}],
                }
            )
        )
        self.alertmanager = _Server(
            "alertmanager",
            [
                ALERTMANAGER,
                f"--config.file={am_conf}",
                f"--storage.path={self.root / 'am-data'}",
                f"--web.listen-address=127.0.0.1:{am_port}",
                "--cluster.listen-address=",  # no gossip peer: one Alertmanager of its own
            ],
            am_port,
            self.root / "alertmanager.log",
        )
        prom_conf = self.root / "prometheus.yml"
        prom_conf.write_text(
            yaml.safe_dump(
                {
                    "global": {
                        "scrape_interval": f"{INTERVAL_S}s",
                        "scrape_timeout": "900ms",
                        "evaluation_interval": f"{INTERVAL_S}s",
                    },
                    "rule_files": [str(self.rules)],
                    "alerting": {
                        "alertmanagers": [{"static_configs": [{"targets": [f"127.0.0.1:{am_port}"]}]}]
                    },
                    "scrape_configs": [
                        {"job_name": job, "static_configs": [{"targets": list(targets)}]}
                        for job, targets in self.jobs.items()
                    ],
                }
            )
        )
        self.prometheus = _Server(
            "prometheus",
            [
                PROMETHEUS,
                f"--config.file={prom_conf}",
                f"--storage.tsdb.path={self.root / 'prom-data'}",
                f"--web.listen-address=127.0.0.1:{prom_port}",
                # Firing alerts go to Alertmanager at every evaluation, not once a minute.
                f"--rules.alert.resend-delay={INTERVAL_S}s",
            ],
            prom_port,
            self.root / "prometheus.log",
        )
        self.servers = [self.alertmanager, self.prometheus]

    def start(self) -> PromStack:
        try:
            for s in self.servers:
                s.start()
            for s in self.servers:
                s.wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        for s in reversed(self.servers):
            s.stop()

    def diagnostics(self) -> str:
        return "\n".join(f"--- {s.name}:\n{s.tail()}" for s in self.servers)


# ---------------------------------------------------------------- reading them


async def query(http: httpx.AsyncClient, prom: str, expr: str) -> list[dict[str, Any]]:
    """The instant vector (or scalar, as one sample) ``expr`` gives now; AssertionError naming the
    expression when Prometheus refuses it."""
    r = await http.get(f"{prom}/api/v1/query", params={"query": expr})
    body = r.json()
    assert r.status_code == 200 and body.get("status") == "success", f"{expr!r}: {r.status_code} {body}"
    data = body["data"]
    if data["resultType"] in ("scalar", "string"):
        return [{"metric": {}, "value": data["result"]}]
    result: list[dict[str, Any]] = data["result"]
    return result


async def targets_up(http: httpx.AsyncClient, prom: str) -> dict[str, str]:
    """``job/instance`` -> health of every scrape target."""
    r = await http.get(f"{prom}/api/v1/targets")
    return {
        f"{t['labels']['job']}/{t['labels']['instance']}": t["health"]
        for t in r.json()["data"]["activeTargets"]
    }


async def rule_alerts(http: httpx.AsyncClient, prom: str) -> list[str]:
    """``name state`` of every alert Prometheus's rules hold now, pending (in its ``for:``) or firing."""
    r = await http.get(f"{prom}/api/v1/alerts")
    return sorted(f"{a['labels']['alertname']} {a['state']}" for a in r.json()["data"]["alerts"])


@dataclass(frozen=True)
class Expect:
    """An alert the test waits for: its name and the labels that tell this one from others of its name."""

    alert: str
    labels: Mapping[str, str] = field(default_factory=dict)

    def matches(self, labels: Mapping[str, str]) -> bool:
        return labels.get("alertname") == self.alert and all(
            labels.get(k) == v for k, v in self.labels.items()
        )

    def __str__(self) -> str:
        inner = ",".join(f'{k}="{v}"' for k, v in sorted(self.labels.items()))
        return f"{self.alert}{{{inner}}}" if inner else self.alert


@dataclass
class AlertLog:
    """What Alertmanager held over time, polled from its API (v2 lists an alert until it is resolved)."""

    am: str
    every: float = 0.25
    # Each poll: (monotonic time, the label sets Alertmanager held then).
    polls: list[tuple[float, list[dict[str, str]]]] = field(default_factory=list)
    errors: int = 0

    async def run(self, http: httpx.AsyncClient) -> None:
        while True:
            try:
                r = await http.get(f"{self.am}/api/v2/alerts")
                r.raise_for_status()
                self.polls.append((time.monotonic(), [dict(a["labels"]) for a in r.json()]))
            except (httpx.HTTPError, ValueError):
                self.errors += 1  # one missed look: the next one sees what it held
            await asyncio.sleep(self.every)

    def held_now(self, want: Expect) -> bool:
        return bool(self.polls) and any(want.matches(a) for a in self.polls[-1][1])

    def fired_at(self, want: Expect, since: float = 0.0) -> float | None:
        """When Alertmanager first held ``want`` at or after ``since``."""
        for t, alerts in self.polls:
            if t >= since and any(want.matches(a) for a in alerts):
                return t
        return None

    def resolved_at(self, want: Expect, since: float = 0.0) -> float | None:
        """When Alertmanager first no longer held ``want`` after holding it (at or after ``since``)."""
        fired = self.fired_at(want, since)
        if fired is None:
            return None
        for t, alerts in self.polls:
            if t > fired and not any(want.matches(a) for a in alerts):
                return t
        return None

    def names_now(self) -> list[str]:
        if not self.polls:
            return []
        return sorted(f"{a['alertname']}{_short(a)}" for a in self.polls[-1][1])


def _short(labels: Mapping[str, str]) -> dict[str, str]:
    return {k: v for k, v in labels.items() if k in ("job", "model", "target")}
