"""The simulator's exposition through prometheus_client: vLLM's names, types, labels and _created
series; llama-server's without; one registry per engine."""

from __future__ import annotations

from prometheus_client import generate_latest

from llmgw_sim.engine import Engine
from llmgw_sim.metrics import LoadSnapshot, render
from llmgw_sim.options import SimOptions
from tests.kit.promtext import samples, value

SNAP = LoadSnapshot(
    running=2,
    waiting=3,
    slots=4,
    prompt_tokens_total=10,
    generation_tokens_total=40,
    requests_total=5,
    prompt_seconds_total=0.5,
    generation_seconds_total=2.0,
)
LABELS = {"engine": "0", "model_name": "m"}


def test_vllm_counters_have_vllms_type_lines_and_created_series() -> None:
    text = render("vllm", SNAP, "m", created=1700000000.0)
    for name in ("vllm:prompt_tokens", "vllm:generation_tokens"):
        # prometheus_client's text format, as vLLM serves it: the TYPE line names the _total sample.
        assert f"# TYPE {name}_total counter\n" in text
        assert f"# TYPE {name}_created gauge\n" in text
        assert value(text, f"{name}_created", **LABELS) == 1700000000.0
    assert value(text, "vllm:prompt_tokens_total", **LABELS) == 10
    assert value(text, "vllm:generation_tokens_total", **LABELS) == 40
    ok = {"engine": "0", "finished_reason": "length", "model_name": "m"}
    assert value(text, "vllm:request_success_total", **ok) == 5
    assert value(text, "vllm:request_success_created", **ok) == 1700000000.0
    assert value(text, "vllm:num_requests_running", **LABELS) == 2


def test_llamacpp_has_no_created_series() -> None:
    text = render("llamacpp", SNAP, "m", created=1700000000.0)
    assert "_created" not in text
    assert "# TYPE llamacpp:prompt_tokens_total counter\n" in text
    assert value(text, "llamacpp:prompt_tokens_total") == 10


def test_each_engine_has_its_own_registry() -> None:
    a = Engine(SimOptions(model="a", metrics_style="vllm"))
    b = Engine(SimOptions(model="b", metrics_style="vllm"))
    a.done(7, 3)
    ta, tb = generate_latest(a.registry), generate_latest(b.registry)
    assert value(ta, "vllm:prompt_tokens_total", engine="0", model_name="a") == 7
    assert value(tb, "vllm:prompt_tokens_total", engine="0", model_name="b") == 0
    assert not any(labels and dict(labels).get("model_name") == "a" for _, labels in samples(tb))
