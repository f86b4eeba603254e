"""Prometheus text of the simulated engine, in the names a real vLLM or llama-server exposes.

vLLM (v1 engine, ``vllm/v1/metrics/loggers.py``): gauges ``vllm:num_requests_running``,
``vllm:num_requests_waiting``, ``vllm:kv_cache_usage_perc`` (0..1) labelled
``engine="0",model_name="<served name>"``, and token and request counters.
llama-server (``--metrics``): ``llamacpp:requests_processing``, ``llamacpp:requests_deferred`` and
token counters, unlabelled; a current build has no KV-cache metric, so neither has this one.
"""

from __future__ import annotations

from dataclasses import dataclass


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

    @property
    def kv_usage(self) -> float:
        """KV-cache use, 0..1: tokens held over capacity, or else the share of slots taken."""
        if self.kv_tokens:
            return min(1.0, self.kv_tokens_used / self.kv_tokens)
        return min(1.0, self.running / self.slots) if self.slots else 0.0


def _label_escape(s: str) -> str:
    return s.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _num(v: float) -> str:
    return repr(float(v))


def render_vllm(s: LoadSnapshot, model: str) -> str:
    labels = f'{{engine="0",model_name="{_label_escape(model)}"}}'
    items = (
        ("vllm:num_requests_running", "gauge", "Number of requests in model execution batches.", s.running),
        ("vllm:num_requests_waiting", "gauge", "Number of requests waiting to be processed.", s.waiting),
        ("vllm:kv_cache_usage_perc", "gauge", "KV-cache usage. 1 means 100 percent usage.", s.kv_usage),
        ("vllm:prompt_tokens_total", "counter", "Number of prefill tokens processed.", s.prompt_tokens_total),
        (
            "vllm:generation_tokens_total",
            "counter",
            "Number of generation tokens processed.",
            s.generation_tokens_total,
        ),
    )
    out: list[str] = []
    for name, kind, doc, value in items:
        out.append(f"# HELP {name} {doc}\n# TYPE {name} {kind}\n{name}{labels} {_num(value)}\n")
    name = "vllm:request_success_total"
    out.append(
        f"# HELP {name} Count of successfully processed requests.\n# TYPE {name} counter\n"
        f'{name}{{engine="0",finished_reason="length",model_name="{_label_escape(model)}"}} '
        f"{_num(s.requests_total)}\n"
    )
    return "".join(out)


def render_llamacpp(s: LoadSnapshot) -> str:
    counters = (
        ("prompt_tokens_total", "Number of prompt tokens processed.", s.prompt_tokens_total),
        ("prompt_seconds_total", "Prompt process time", s.prompt_seconds_total),
        ("tokens_predicted_total", "Number of generation tokens processed.", s.generation_tokens_total),
        ("tokens_predicted_seconds_total", "Predict process time", s.generation_seconds_total),
        ("n_decode_total", "Total number of llama_decode() calls", s.generation_tokens_total),
    )
    prompt_rate = s.prompt_tokens_total / s.prompt_seconds_total if s.prompt_seconds_total else 0.0
    gen_rate = s.generation_tokens_total / s.generation_seconds_total if s.generation_seconds_total else 0.0
    gauges = (
        ("prompt_tokens_seconds", "Average prompt throughput in tokens/s.", prompt_rate),
        ("predicted_tokens_seconds", "Average generation throughput in tokens/s.", gen_rate),
        ("requests_processing", "Number of requests processing.", s.running),
        ("requests_deferred", "Number of requests deferred.", s.waiting),
    )
    out: list[str] = []
    for kind, items in (("counter", counters), ("gauge", gauges)):
        for name, doc, value in items:
            full = "llamacpp:" + name
            out.append(f"# HELP {full} {doc}\n# TYPE {full} {kind}\n{full} {_num(value)}\n")
    return "".join(out)


def render(style: str, s: LoadSnapshot, model: str) -> str:
    return render_vllm(s, model) if style == "vllm" else render_llamacpp(s)
