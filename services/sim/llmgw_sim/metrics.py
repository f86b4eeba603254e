"""Prometheus exposition of the simulated engine, in the names a real vLLM or llama-server exposes.

vLLM (v1 engine, ``vllm/v1/metrics/loggers.py``): gauges ``vllm:num_requests_running``,
``vllm:num_requests_waiting``, ``vllm:kv_cache_usage_perc`` (0..1) labelled
``engine="0",model_name="<served name>"``, token counters (the prefix cache's too, 0 without one) and
request counters, each with the ``_created`` series ``prometheus_client`` adds (vLLM 0.32 leaves them
on: its /metrics has one per counter series).
llama-server (``--metrics``, not prometheus_client): ``llamacpp:requests_processing``,
``llamacpp:requests_deferred`` and token counters, unlabelled, no ``_created``; a current build has no
KV-cache metric, so neither has this one.

The engine counts in plain integers on its request path; a :class:`SimCollector` reads them only when
``/metrics`` is scraped, so a request pays nothing for the exposition.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector


@dataclass(frozen=True, slots=True)
class LoadSnapshot:
    running: int
    waiting: int
    slots: int
    prompt_tokens_total: int
    generation_tokens_total: int
    requests_total: int
    # Seconds spent producing prompt and generated tokens, summed over requests.
    prompt_seconds_total: float
    generation_seconds_total: float
    # Tokens held by running requests, and the capacity (None: KV use is the share of slots).
    kv_tokens_used: int = 0
    kv_tokens: int | None = None
    # The prefix cache, in tokens: those of the prompts looked up, and of their cached prefixes.
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    # LoRA (None: not served): vllm:lora_requests_info's series, (adapters with requests, time set).
    max_loras: int | None = None
    lora_info: tuple[tuple[str, float], ...] = ()

    @property
    def kv_usage(self) -> float:
        """KV-cache use, 0..1: tokens held over capacity, or else the share of slots taken."""
        if self.kv_tokens:
            return min(1.0, self.kv_tokens_used / self.kv_tokens)
        return min(1.0, self.running / self.slots) if self.slots else 0.0


def vllm_families(s: LoadSnapshot, model: str, created: float) -> Iterator[Metric]:
    names, values = ["engine", "model_name"], ["0", model]
    gauges = (
        ("vllm:num_requests_running", "Number of requests in model execution batches.", s.running),
        ("vllm:num_requests_waiting", "Number of requests waiting to be processed.", s.waiting),
        ("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", s.kv_usage),
    )
    for name, doc, value in gauges:
        g = GaugeMetricFamily(name, doc, labels=names)
        g.add_metric(values, value)
        yield g
    counters = (
        ("vllm:prompt_tokens", "Number of prefill tokens processed.", s.prompt_tokens_total),
        ("vllm:generation_tokens", "Number of generation tokens processed.", s.generation_tokens_total),
        (
            "vllm:prefix_cache_queries",
            "Prefix cache queries, in terms of number of queried tokens.",
            s.prefix_cache_queries,
        ),
        (
            "vllm:prefix_cache_hits",
            "Prefix cache hits, in terms of number of cached tokens.",
            s.prefix_cache_hits,
        ),
        (
            "vllm:prompt_tokens_cached",
            "Number of cached prompt tokens (local + external).",
            s.prefix_cache_hits,
        ),
    )
    for name, doc, value in counters:
        c = CounterMetricFamily(name, doc, labels=names)
        c.add_metric(values, value, created=created)
        yield c
    # Every simulated answer ends at its length: the one finished_reason it can have.
    ok = CounterMetricFamily(
        "vllm:request_success",
        "Count of successfully processed requests.",
        labels=["engine", "finished_reason", "model_name"],
    )
    ok.add_metric(["0", "length", model], s.requests_total, created=created)
    yield ok
    if s.max_loras is not None:
        # vLLM's gauge set to the time of each scheduler step; both lists name every adapter with a
        # request running or waiting (vLLM 0.32), and an old label set keeps its old time.
        info = GaugeMetricFamily(
            "vllm:lora_requests_info",
            "Running stats on lora requests.",
            labels=["max_lora", "running_lora_adapters", "waiting_lora_adapters"],
        )
        for adapters, at in s.lora_info:
            info.add_metric([str(s.max_loras), adapters, adapters], at)
        yield info


def llamacpp_families(s: LoadSnapshot) -> Iterator[Metric]:
    counters = (
        ("prompt_tokens", "Number of prompt tokens processed.", s.prompt_tokens_total),
        ("prompt_seconds", "Prompt process time", s.prompt_seconds_total),
        ("tokens_predicted", "Number of generation tokens processed.", s.generation_tokens_total),
        ("tokens_predicted_seconds", "Predict process time", s.generation_seconds_total),
        ("n_decode", "Total number of llama_decode() calls", s.generation_tokens_total),
    )
    for name, doc, value in counters:
        yield CounterMetricFamily("llamacpp:" + name, doc, value=value)
    prompt_rate = s.prompt_tokens_total / s.prompt_seconds_total if s.prompt_seconds_total else 0.0
    gen_rate = s.generation_tokens_total / s.generation_seconds_total if s.generation_seconds_total else 0.0
    gauges = (
        ("prompt_tokens_seconds", "Average prompt throughput in tokens/s.", prompt_rate),
        ("predicted_tokens_seconds", "Average generation throughput in tokens/s.", gen_rate),
        ("requests_processing", "Number of requests processing.", s.running),
        ("requests_deferred", "Number of requests deferred.", s.waiting),
    )
    for name, doc, value in gauges:
        yield GaugeMetricFamily("llamacpp:" + name, doc, value=value)


class SimCollector(Collector):
    """The engine's metrics in ``style`` ("vllm" or "llamacpp"), read from ``snapshot`` at each scrape."""

    def __init__(self, style: str, model: str, snapshot: Callable[[], LoadSnapshot], created: float) -> None:
        self.style = style
        self.model = model
        self.snapshot = snapshot
        self.created = created

    def collect(self) -> Iterator[Metric]:
        s = self.snapshot()
        if self.style == "vllm":
            return vllm_families(s, self.model, self.created)
        return llamacpp_families(s)


def sim_registry(
    style: str, model: str, snapshot: Callable[[], LoadSnapshot], created: float
) -> CollectorRegistry:
    """A registry of this engine's own (not the process-wide default: tests run many engines in one);
    ``created``: the wall time its counters started from."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(SimCollector(style, model, snapshot, created))
    return registry


def render(style: str, s: LoadSnapshot, model: str, created: float = 0.0) -> str:
    """The exposition text of one snapshot."""
    return generate_latest(sim_registry(style, model, lambda: s, created)).decode()
