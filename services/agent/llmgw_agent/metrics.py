"""Engine metrics: a tolerant Prometheus text parser and the per-engine names of running, waiting, KV use.

The parser reads only what the agent needs (sample name and value); it never raises on a bad line,
because one odd line from an engine must not blank a whole load report. It is not
``prometheus_client.parser`` for two reasons, both tested (``tests/agent/test_agent_metrics_parser.py``,
which also holds this parser to that one's sums on a real vLLM page): that one stops at the first line
it cannot read, and on a real vLLM /metrics page (576 lines, 47 KB) it took 27-45 ms against this one's
2 ms (2026-12-01, a loaded 2-core box): the agent parses each engine's page every tick, on its event
loop, so eight engines would block it a fifth of every second.

Mappings follow one rule (issue 4): a mapping that names its own ``running`` metric is complete, and
the fields it leaves blank stay blank (``None`` in the load report, never 0). A mapping that does not
name ``running`` (including an empty one) is laid over vLLM's names.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, replace


@dataclass(frozen=True, slots=True)
class MetricNames:
    """Which samples hold running, waiting and KV-cache use; ``kv_use`` lists fallbacks, first wins."""

    running: str | None
    waiting: str | None
    kv_use: tuple[str, ...] = ()

    @classmethod
    def from_mapping(cls, mapping: Mapping[str, object] | None, default: MetricNames) -> MetricNames:
        """Names from a profile's ``metrics`` option: None keeps ``default``; see the module rule."""
        if mapping is None:
            return default
        kv_raw = mapping.get("kv_use")
        kv: tuple[str, ...] | None
        if kv_raw is None or kv_raw == "":
            kv = None
        elif isinstance(kv_raw, str):
            kv = (kv_raw,)
        elif isinstance(kv_raw, list | tuple):
            kv = tuple(str(x) for x in kv_raw if x)
        else:
            raise ValueError(f"metrics.kv_use must be a name or a list of names, not {type(kv_raw).__name__}")
        unknown = set(mapping) - {"running", "waiting", "kv_use"}
        if unknown:
            raise ValueError(
                f"unknown metrics field(s): {', '.join(sorted(unknown))} (known: running, waiting, kv_use)"
            )
        running = _name(mapping.get("running"), "running")
        waiting = _name(mapping.get("waiting"), "waiting")
        if running is not None:
            return cls(running=running, waiting=waiting, kv_use=kv or ())
        base = VLLM_METRICS
        return replace(
            base,
            waiting=waiting if waiting is not None else base.waiting,
            kv_use=kv if kv is not None else base.kv_use,
        )


def _name(v: object, field: str) -> str | None:
    if v is None or v == "":
        return None
    if not isinstance(v, str):
        raise ValueError(f"metrics.{field} must be a metric name, not {type(v).__name__}")
    return v


VLLM_METRICS = MetricNames(
    running="vllm:num_requests_running",
    waiting="vllm:num_requests_waiting",
    # vLLM V1 renamed gpu_cache_usage_perc to kv_cache_usage_perc; both are fractions 0..1.
    kv_use=("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"),
)

LLAMACPP_METRICS = MetricNames(
    running="llamacpp:requests_processing",
    waiting="llamacpp:requests_deferred",
    # Only older llama-server builds export it; a current build has none, so kv_use stays None.
    kv_use=("llamacpp:kv_cache_usage_ratio",),
)


def parse_prometheus(text: str) -> dict[str, float]:
    """Sample name -> value, summed over label sets (an engine with several workers reports each).

    Comment lines, blank lines and lines that do not parse are skipped; NaN samples are ignored.
    """
    out: dict[str, float] = {}
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        brace = line.find("{")
        space = line.find(" ")
        if brace != -1 and (space == -1 or brace < space):
            name = line[:brace]
            close = line.rfind("}")
            if close < brace:
                continue
            rest = line[close + 1 :].split()
        else:
            parts = line.split()
            name, rest = parts[0], parts[1:]
        if not name or not rest:
            continue
        try:
            value = float(rest[0])
        except ValueError:
            continue
        if math.isnan(value):
            continue
        out[name] = out.get(name, 0.0) + value
    return out


# vLLM's own prefix-cache counters (tokens looked up, tokens found cached since the engine started); the
# simulator in vLLM's style has them too, llama.cpp none. For operators: predicted against engine hit rate.
PREFIX_QUERIES = "vllm:prefix_cache_queries_total"
PREFIX_HITS = "vllm:prefix_cache_hits_total"


@dataclass(frozen=True, slots=True)
class LoadSample:
    running: float | None
    waiting: float | None
    kv_use: float | None
    prefix_queries: float | None = None
    prefix_hits: float | None = None


def extract_load(samples: Mapping[str, float], names: MetricNames) -> LoadSample:
    """Running, waiting and KV use from parsed samples; a metric the engine lacks is None, never 0."""
    kv: float | None = None
    for n in names.kv_use:
        if n in samples:
            kv = samples[n]
            break
    return LoadSample(
        running=samples.get(names.running) if names.running else None,
        waiting=samples.get(names.waiting) if names.waiting else None,
        kv_use=kv,
        prefix_queries=samples.get(PREFIX_QUERIES),
        prefix_hits=samples.get(PREFIX_HITS),
    )


# vLLM's LoRA gauge (issue 33): its value is the time it was set, one series per label set ever seen.
LORA_INFO = "vllm:lora_requests_info"
_LORA_LABELS = ("running_lora_adapters", "waiting_lora_adapters")


def lora_busy(text: str) -> tuple[str, ...] | None:
    """The adapters with requests running or waiting, from the newest ``vllm:lora_requests_info``
    series of a /metrics page (vLLM keeps every label set it has seen, each with the time it was last
    set); None when the page has no such series (no LoRA, or not vLLM's names)."""
    newest: tuple[float, str] | None = None
    for raw in text.splitlines():
        if not raw.startswith(LORA_INFO + "{"):
            continue
        close = raw.rfind("}")
        try:
            value = float(raw[close + 1 :].split()[0])
        except (ValueError, IndexError):
            continue
        if newest is None or value >= newest[0]:
            newest = (value, raw[len(LORA_INFO) + 1 : close])
    if newest is None:
        return None
    labels = _labels(newest[1])
    names: dict[str, None] = {}
    for label in _LORA_LABELS:
        for name in labels.get(label, "").split(","):
            if name:
                names[name] = None
    return tuple(names)


def _labels(text: str) -> dict[str, str]:
    """Prometheus label text (``a="x",b="y"``) as a mapping; escapes (\\", \\\\, \\n) undone."""
    out: dict[str, str] = {}
    i, n = 0, len(text)
    while i < n:
        eq = text.find("=", i)
        if eq < 0 or eq + 1 >= n or text[eq + 1] != '"':
            break
        key = text[i:eq].strip().lstrip(",").strip()
        j = eq + 2
        value: list[str] = []
        while j < n and text[j] != '"':
            if text[j] == "\\" and j + 1 < n:
                j += 1
                value.append("\n" if text[j] == "n" else text[j])
            else:
                value.append(text[j])
            j += 1
        out[key] = "".join(value)
        i = j + 1
    return out
