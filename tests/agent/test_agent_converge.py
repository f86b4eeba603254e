"""plan_converge: the pure decision of what to start, stop, adopt and refuse."""

from __future__ import annotations

from llmgw_agent.converge import Running, plan_converge
from llmgw_agent.engines import LaunchSpec, Refusal
from llmgw_agent.metrics import VLLM_METRICS


def spec(tag: str) -> LaunchSpec:
    return LaunchSpec(argv=("engine", tag), env={}, health_url=None, metrics_url=None, metrics=VLLM_METRICS)


A, B, C = ("a", 0), ("b", 0), ("c", 1)


def test_start_new_and_stop_unassigned() -> None:
    p = plan_converge({A: spec("1")}, {B: Running(spec("2").fingerprint)}, {})
    assert (p.start, p.stop, p.adopt, p.refuse, p.stop_orphans) == ([A], [B], [], [], [])


def test_unchanged_is_left_alone_even_when_failed() -> None:
    s = spec("1")
    p = plan_converge({A: s}, {A: Running(s.fingerprint, error="exited with code 1")}, {})
    assert p.empty


def test_changed_fingerprint_restarts() -> None:
    p = plan_converge({A: spec("new")}, {A: Running(spec("old").fingerprint)}, {})
    assert (p.stop, p.start) == ([A], [A])


def test_adopt_when_still_assigned_with_same_command_else_stop_orphan() -> None:
    p = plan_converge(
        {A: spec("1"), B: spec("2")},
        {},
        {A: spec("1").fingerprint, B: spec("changed").fingerprint, C: spec("3").fingerprint},
    )
    assert p.adopt == [A]
    assert p.stop_orphans == [B, C]
    assert p.start == [B]


def test_refusal_recorded_once_and_replaces_a_running_engine() -> None:
    r = Refusal("vLLM needs a GPU")
    assert plan_converge({A: r}, {}, {}).refuse == [A]
    assert plan_converge({A: r}, {A: Running(None, error="vLLM needs a GPU")}, {}).empty
    p = plan_converge({A: r}, {A: Running(spec("1").fingerprint)}, {})
    assert (p.stop, p.refuse) == ([A], [A])
    # Refused before, runnable now: the failed record goes and the engine starts.
    p2 = plan_converge({A: spec("1")}, {A: Running(None, error="vLLM needs a GPU")}, {})
    assert (p2.stop, p2.start) == ([A], [A])


def test_adoptable_that_is_also_running_is_not_adopted_twice() -> None:
    s = spec("1")
    p = plan_converge({A: s}, {A: Running(s.fingerprint)}, {A: s.fingerprint})
    assert (p.adopt, p.stop_orphans, p.start) == ([], [A], [])
