"""The vLLM adapter passes the agent's OTLP endpoint to its engines (issue 34, docs/tracing.md)."""

from __future__ import annotations

from tests.agent.test_agent_engines import flag, settings, shard, spec_of

URL = "http://collector:4318/v1/traces"


def test_no_endpoint_no_flag() -> None:
    s = spec_of(shard(gpus=(0,)), settings())
    assert "--otlp-traces-endpoint" not in s.argv
    assert "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL" not in s.env


def test_an_endpoint_reaches_vllm_over_http() -> None:
    s = spec_of(shard(gpus=(0,)), settings(otlp_traces_endpoint=URL))
    assert flag(s.argv, "--otlp-traces-endpoint") == URL
    # vLLM's exporter speaks gRPC unless told: the endpoint is OTLP/HTTP, as the router's.
    assert s.env["OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"] == "http/protobuf"
    assert s.env["OTEL_SERVICE_NAME"] == "vllm"


def test_the_profiles_own_endpoint_wins() -> None:
    own = "http://other:4317"
    s = spec_of(shard(gpus=(0,), args=("--otlp-traces-endpoint", own)), settings(otlp_traces_endpoint=URL))
    assert s.argv.count("--otlp-traces-endpoint") == 1 and flag(s.argv, "--otlp-traces-endpoint") == own
    assert "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL" not in s.env


def test_the_simulator_gets_nothing() -> None:
    s = spec_of(shard(engine="sim"), settings(otlp_traces_endpoint=URL))
    assert "--otlp-traces-endpoint" not in s.argv
