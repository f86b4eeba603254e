"""The restart policy of `llmgw up` (pure, on a fake clock): doubling delays up to a cap, reset after a
healthy run, a count per child."""

from __future__ import annotations

from llmgw_cli.restarts import Restarts


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_a_crash_loop_backs_off_doubling_up_to_the_cap_and_counts_restarts() -> None:
    clock = Clock()
    r = Restarts(base_s=1.0, max_s=5.0, healthy_after_s=60.0, clock=clock)
    delays = []
    for _ in range(5):
        delays.append(r.died("router", ran_s=0.5))
        assert r.pending("router") and not r.due("router")
        clock.t += delays[-1] - 0.01
        assert not r.due("router")
        clock.t += 0.01
        assert r.due("router")
        r.restarted("router")
        assert not r.pending("router")
    assert delays == [1.0, 2.0, 4.0, 5.0, 5.0]
    assert r.count == {"router": 5}


def test_a_child_that_ran_long_starts_its_backoff_over_and_children_are_apart() -> None:
    clock = Clock()
    r = Restarts(base_s=1.0, max_s=30.0, healthy_after_s=60.0, clock=clock)
    assert [r.died("agent-a", ran_s=1.0) for _ in range(3)] == [1.0, 2.0, 4.0]
    assert r.died("agent-a", ran_s=61.0) == 1.0  # it served a while: not a crash loop
    assert r.died("nats-server", ran_s=0.0) == 1.0  # another child's failures are its own
    assert r.count == {}  # nothing restarted yet
