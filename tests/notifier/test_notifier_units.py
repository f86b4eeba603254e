"""Pure parts of the notifier, with a fake clock: grouping, backoff, probe state, formats, the gate."""

from __future__ import annotations

import json
import logging

import httpx
import pytest
from hypothesis import given
from hypothesis import strategies as st

from llmgw_common.backoff import jittered_delay
from llmgw_common.catalog import WatchSpec
from llmgw_common.messages import Event, Webhook
from llmgw_common.urls import shown_url
from llmgw_notifier.delivery import wants
from llmgw_notifier.formats import group_id, render, sign, slack_text, verify
from llmgw_notifier.grouping import Held, plan_groups
from llmgw_notifier.outages import DOWN, RECOVERED, Outage, Verdict, fold
from llmgw_notifier.posting import post_until_taken, retry_after_s
from llmgw_notifier.probe_state import ProbeState, event_id, observe, probe_event
from llmgw_notifier.settings import NotifierSettings
from llmgw_notifier.start_gate import StartGate
from tests.notifier.notifier_helpers import FakeTime


def e(kind: str, subject: str, t: float, n: int = 0) -> Event:
    return Event(id=f"{kind}:{subject}:{n}", kind=kind, subject=subject, time=t, summary=f"{subject} {kind}")


def held(seq: int, kind: str, subject: str, t: float, seen: float | None = None) -> Held:
    return Held(seq, e(kind, subject, t, seq), t if seen is None else seen)


# ---------------------------------------------------------------- grouping


def test_forty_nodes_lost_in_one_minute_is_one_message_after_the_window() -> None:
    items = [held(i, "node.lost", f"gpu-{i}", 1000.0 + i * 0.2) for i in range(1, 41)]
    waiting = plan_groups(items, now=1005.0, window=10.0)
    assert waiting.ready == () and waiting.wake_at == pytest.approx(1010.2)
    done = plan_groups(items, now=1010.2, window=10.0)
    assert len(done.ready) == 1
    assert [x.subject for x in done.ready[0].events] == [f"gpu-{i}" for i in range(1, 41)]
    assert done.wake_at is None


def test_groups_go_out_as_a_ready_prefix_in_order_of_their_first_event() -> None:
    items = [
        held(1, "node.lost", "a", 100.0),
        held(2, "model.down", "m", 101.0),
        held(3, "node.lost", "b", 102.0),
    ]
    plan = plan_groups(items, now=110.5, window=10.0)
    # node.lost opened at 100 is due at 110; model.down at 111: only the first goes.
    assert [g.kind for g in plan.ready] == ["node.lost"]
    assert [x.subject for x in plan.ready[0].events] == ["a", "b"]
    assert plan.wake_at == pytest.approx(111.0)


def test_a_later_event_outside_the_window_closes_the_group_early() -> None:
    items = [held(1, "node.lost", "a", 100.0, seen=200.0), held(2, "node.lost", "b", 120.0, seen=200.0)]
    plan = plan_groups(items, now=200.0, window=10.0)
    assert [len(g.items) for g in plan.ready] == [1]  # a is closed by b; b waits for its own window
    assert plan.wake_at == pytest.approx(210.0)


def test_window_zero_sends_each_event_at_once_and_full_groups_split() -> None:
    items = [held(i, "node.lost", f"n{i}", 100.0) for i in range(1, 6)]
    assert [len(g.items) for g in plan_groups(items, now=100.0, window=0).ready] == [1] * 5
    split = plan_groups(items, now=100.0, window=10.0, max_group=2)
    assert [len(g.items) for g in split.ready] == [2, 2]  # the last one is not full: it waits
    assert split.wake_at == pytest.approx(110.0)


@given(st.lists(st.tuples(st.sampled_from(["node.lost", "model.down"]), st.floats(0, 100)), max_size=30))
def test_grouping_loses_nothing_and_keeps_order_within_a_kind(raw: list[tuple[str, float]]) -> None:
    items = [held(i, k, f"s{i}", t) for i, (k, t) in enumerate(raw)]
    plan = plan_groups(items, now=1e9, window=5.0)
    out = [h.seq for g in plan.ready for h in g.items]
    assert sorted(out) == list(range(len(items)))
    for kind in ("node.lost", "model.down"):
        seqs = [h.seq for g in plan.ready if g.kind == kind for h in g.items]
        assert seqs == sorted(seqs)


# ---------------------------------------------------------------- retries


def test_backoff_doubles_to_the_cap_with_jitter_in_the_upper_half() -> None:
    assert jittered_delay(1, 1.0, 60.0, 0.0) == 0.5
    assert jittered_delay(1, 1.0, 60.0, 0.999) == pytest.approx(0.9995)
    assert jittered_delay(4, 1.0, 60.0, 1.0) == 8.0
    assert jittered_delay(30, 1.0, 60.0, 1.0) == 60.0
    assert jittered_delay(30, 1.0, 60.0, 0.0) == 30.0


async def test_post_gives_up_after_retry_for_and_honours_retry_after() -> None:
    t = FakeTime()

    def handler(req: httpx.Request) -> httpx.Response:
        return httpx.Response(429, headers={"Retry-After": "7"}, text="slow down")

    s = NotifierSettings(retry_for_s=30.0, retry_base_s=1.0, retry_max_s=4.0)
    msg = render([e("node.lost", "a", 1.0)], Webhook(url="http://x/hook"))
    async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
        out = await post_until_taken(
            client, "http://x/hook", msg, s, clock=t.clock, sleep=t.sleep, rng=lambda: 0.0
        )
    assert not out.ok and out.last_error is not None and "429" in out.last_error
    assert all(d >= 7.0 for d in t.sleeps[:-1])  # the receiver's Retry-After beats our shorter backoff
    assert sum(t.sleeps) == pytest.approx(30.0)  # bounded by retry_for_s
    assert out.attempts == len(t.sleeps) + 1


async def test_post_retries_connection_errors_then_succeeds() -> None:
    t = FakeTime()
    calls = []

    def handler(req: httpx.Request) -> httpx.Response:
        calls.append(req)
        if len(calls) < 3:
            raise httpx.ConnectError("refused", request=req)
        return httpx.Response(204)

    s = NotifierSettings(retry_for_s=30.0, retry_base_s=1.0, retry_max_s=4.0)
    msg = render([e("node.lost", "a", 1.0)], Webhook(url="http://x/hook", secret="k"))
    async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
        out = await post_until_taken(
            client, "http://x/hook", msg, s, clock=t.clock, sleep=t.sleep, rng=lambda: 1.0
        )
    assert out.ok and out.attempts == 3 and t.sleeps == [1.0, 2.0]
    assert verify(calls[-1].content, "k", calls[-1].headers["X-Llmgw-Signature"])


def test_retry_after_parsing() -> None:
    assert retry_after_s(httpx.Response(429, headers={"Retry-After": "3"})) == 3.0
    assert (
        retry_after_s(httpx.Response(429, headers={"Retry-After": "Wed, 21 Oct 2015 07:28:00 GMT"})) is None
    )
    assert retry_after_s(httpx.Response(500)) is None


def test_event_filters() -> None:
    assert wants(Webhook(url="u"), "node.lost")
    assert wants(Webhook(url="u", events=("node.*",)), "node.lost")
    assert not wants(Webhook(url="u", events=("node.*",)), "model.down")
    assert wants(Webhook(url="u", events=("model.down", "placement.failing")), "placement.failing")
    assert not wants(Webhook(url="u", events=()), "node.lost")


def test_start_gate_holds_newer_events_until_the_old_ones_come_back() -> None:
    gate = StartGate(last_delivered=10, outstanding=2, deadline=50.0)
    assert gate.admits(9, now=0.0) and not gate.admits(11, now=0.0)
    gate.saw(12)  # newer: does not count
    gate.saw(7)
    assert not gate.admits(11, now=0.0)
    gate.saw(7)  # the same one again: still one
    assert not gate.is_open(0.0)
    gate.saw(9)
    assert gate.admits(11, now=0.0)
    assert StartGate(10, 5, deadline=50.0).admits(11, now=50.0)  # the deadline opens it regardless
    assert StartGate(10, 2, deadline=50.0, already=[3, 4]).is_open(0.0)  # held before a rebind count
    assert StartGate(0, 0, deadline=50.0).admits(1, now=0.0)  # a fresh consumer has nothing to wait for


# ---------------------------------------------------------------- probes


def test_probe_state_down_once_then_recovered_once() -> None:
    st0 = ProbeState(answered=True)
    st1, tr = observe(st0, False, 100.0, 3, "HTTP 503")
    assert tr is None and st1.failures == 1 and st1.streak_start == 100.0
    st2, tr = observe(st1, False, 130.0, 3, "timeout")
    assert tr is None
    st3, tr = observe(st2, False, 160.0, 3, "timeout")
    assert tr is not None and tr.kind == DOWN and tr.episode == 100.0 and st3.down_since == 100.0
    st4, tr = observe(st3, False, 190.0, 3, "timeout")
    assert tr is None and st4.failures == 4  # no second model.down
    st5, tr = observe(st4, True, 220.0, 3)
    assert (
        tr is not None and tr.kind == RECOVERED and tr.episode == 100.0 and st5 == ProbeState(answered=True)
    )
    _st6, tr = observe(st5, True, 250.0, 3)
    assert tr is None


def test_a_success_resets_the_streak() -> None:
    st1, _ = observe(ProbeState(answered=True), False, 1.0, 2)
    st2, tr = observe(st1, True, 2.0, 2)
    assert tr is None and st2 == ProbeState(answered=True)
    st3, tr = observe(st2, False, 3.0, 2)
    assert tr is None and st3.streak_start == 3.0


def test_failures_before_the_model_was_ever_up_do_not_count() -> None:
    st = ProbeState()
    for t in range(10):  # its first replica is still starting: not down, however long
        st, tr = observe(st, False, float(t), 2, "HTTP 503")
        assert tr is None
    assert st.failures == 0 and st.streak_start is None and st.last_error == "HTTP 503"
    st, tr = observe(st, True, 10.0, 2)
    assert tr is None and st.answered
    st, _ = observe(st, False, 11.0, 2, "timeout")
    st, tr = observe(st, False, 12.0, 2, "timeout")
    assert tr is not None and tr.kind == DOWN and tr.episode == 11.0


def test_probe_events_have_stable_ids_sharing_the_episode() -> None:
    spec = WatchSpec(probe_every=30, budget=20, failures=3)
    st_down = ProbeState(failures=3, streak_start=100.0, down_since=100.0, last_error="no answer within 20s")
    down = probe_event(
        "judge",
        observe(ProbeState(2, 100.0, answered=True), False, 160, 3)[1] or pytest.fail(),
        st_down,
        spec,
        160.0,
        "r",
    )
    assert down.id == event_id(DOWN, "judge", 100.0) == "model.down:judge:probe:100000"
    assert "judge" in down.summary and "20s" in down.summary and down.details["source"] == "probe"
    rec = probe_event(
        "judge", observe(st_down, True, 400.0, 3)[1] or pytest.fail(), ProbeState(), spec, 400.0, "r"
    )
    assert rec.id == "model.recovered:judge:probe:100000" and rec.details["down_for_s"] == 300.0


# ---------------------------------------------------------------- formats


def test_slack_text_says_what_where_since_when_and_what_to_do() -> None:
    text = slack_text([Event(id="x", kind="node.lost", subject="gpu-a3", time=43380.0, summary="")])
    assert "node lost" in text and "gpu-a3" in text and "12:03:00 UTC" in text and "`llmgw ctl nodes`" in text
    many = slack_text([e("node.lost", f"n{i}", 43380.0 + i) for i in range(40)])
    assert many.startswith(":red_circle: *40 nodes lost between 12:03:00 UTC and 12:03:39 UTC*")
    assert "… and 15 more" in many
    odd = slack_text([e("something.new", "x", 1.0)])
    assert "something.new" in odd


def test_json_render_signature_and_group_ids() -> None:
    one = e("model.down", "judge", 5.0, 1)
    r = render([one], Webhook(url="u", secret="topsecret"))
    body = json.loads(r.body)
    assert body["id"] == one.id and r.headers["X-Llmgw-Event-Id"] == one.id
    assert r.headers["X-Llmgw-Signature"] == sign(r.body, "topsecret")
    assert verify(r.body, "topsecret", r.headers["X-Llmgw-Signature"])
    assert not verify(r.body, "topsecret", None)
    assert "X-Llmgw-Signature" not in render([one], Webhook(url="u")).headers
    pair = [e("node.lost", "a", 1.0, 1), e("node.lost", "b", 2.0, 2)]
    assert group_id(pair) == group_id(list(pair)) != group_id(pair[:1])
    with pytest.raises(ValueError):
        render([], Webhook(url="u"))


def test_webhook_urls_are_shown_without_their_secret_path() -> None:
    url = "https://hooks.slack.com/services/T000/B000/XXXXSECRET"
    shown = shown_url(url)
    assert "XXXXSECRET" not in shown and "T000" not in shown and shown.startswith("https://hooks.slack.com/")
    assert shown != shown_url(url + "2")  # two targets on one host stay apart
    assert "pw" not in shown_url("https://user:pw@example.com/h")


# ---------------------------------------------------------------- one outage, two sources


def cp(kind: str, t: float) -> Event:
    """A control plane event: no ``source`` in its details."""
    return Event(id=f"{kind}:judge:{int(t * 1000)}", kind=kind, subject="judge", time=t, summary=f"cp {kind}")


def pr(kind: str, t: float, episode: float) -> Event:
    return Event(
        id=f"{kind}:judge:probe:{int(episode * 1000)}",
        kind=kind,
        subject="judge",
        time=t,
        summary=f"probe {kind}",
        details={"source": "probe", "since": episode},
    )


def run(events: list[Event], outage: Outage | None = None) -> tuple[Outage | None, list[Verdict]]:
    out = []
    for ev in events:
        outage, v = fold(outage, ev)
        out.append(v)
    return outage, out


def sent(verdicts: list[Verdict]) -> list[str]:
    return [v.event.id for v in verdicts if v.deliver]


def test_two_sources_of_one_outage_are_one_down_and_one_recovered() -> None:
    events = [cp(DOWN, 10), pr(DOWN, 14, 11), cp(RECOVERED, 20), pr(RECOVERED, 22, 11)]
    outage, verdicts = run(events)
    assert outage is None
    assert sent(verdicts) == [events[0].id, events[3].id]
    down, dup, early, rec = verdicts
    assert down.event.details["sources"] == ["controlplane"]
    assert not dup.deliver and "already reported down by controlplane" in dup.reason
    assert not early.deliver and "still down according to probe" in early.reason
    assert rec.event.details["sources"] == ["controlplane", "probe"]
    assert rec.event.details["down_since"] == 10 and rec.event.details["down_id"] == events[0].id
    assert "controlplane and probe" in rec.event.summary and rec.event.id == events[3].id


def test_either_order_and_a_single_source() -> None:
    # The probes first, the control plane's recovery last.
    events = [pr(DOWN, 14, 11), cp(DOWN, 15), pr(RECOVERED, 22, 11), cp(RECOVERED, 23)]
    _, verdicts = run(events)
    # A real answer ends the outage; the control plane's late recovery is then dropped.
    assert sent(verdicts) == [events[0].id, events[2].id]
    assert verdicts[2].event.details["cleared"] == ["controlplane"]
    assert "no open model.down from controlplane" in verdicts[3].reason
    # The control plane's recovery while the probes still fail is held back until they answer.
    events = [pr(DOWN, 14, 11), cp(DOWN, 15), cp(RECOVERED, 20), pr(RECOVERED, 22, 11)]
    assert sent(run(events)[1]) == [events[0].id, events[3].id]
    # One source only: both of its events go.
    events = [cp(DOWN, 10), cp(RECOVERED, 20), pr(DOWN, 30, 29), pr(RECOVERED, 40, 29)]
    assert sent(run(events)[1]) == [e.id for e in events]


def test_a_source_that_lost_track_starts_a_new_outage_and_strays_are_dropped() -> None:
    # The control plane restarted mid-outage: it never said recovered, and says down again only after
    # it saw the model ready, so the second down is a new outage.
    events = [cp(DOWN, 10), cp(DOWN, 50), cp(RECOVERED, 60)]
    outage, verdicts = run(events)
    assert sent(verdicts) == [e.id for e in events] and outage is None
    assert verdicts[1].event.details["previous_down"] == events[0].id
    # A recovery nobody announced the down of, and other kinds, pass through the fold as they are.
    outage, (stray,) = run([pr(RECOVERED, 5, 1)])
    assert outage is None and not stray.deliver
    lost = Event(id="n", kind="node.lost", subject="n1", time=1.0)
    assert fold(None, lost) == (None, Verdict(True, lost))


@given(
    st.lists(
        st.tuples(st.sampled_from(["controlplane", "probe"]), st.sampled_from([DOWN, RECOVERED])), max_size=40
    )
)
def test_delivered_downs_and_recoveries_alternate(steps: list[tuple[str, str]]) -> None:
    """Whatever the sources say, in whatever order, the operator hears down, recovered, down, ..."""
    events = [
        (cp(kind, float(i)) if src == "controlplane" else pr(kind, float(i), float(i)))
        for i, (src, kind) in enumerate(steps)
    ]
    outage, verdicts = run(events)
    out = [v.event for v in verdicts if v.deliver]
    last = RECOVERED
    for e in out:
        if e.kind == RECOVERED:
            assert last == DOWN  # never a recovery without a down
        elif last == DOWN:
            assert "previous_down" in e.details  # a second down only when a source lost track
        last = e.kind
    assert (outage is not None) == (last == DOWN)


def test_a_webhook_url_no_client_can_post_to_is_skipped_and_the_others_kept(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A URL written straight into the settings key (setup refuses it) must not crash-loop its worker:
    ``shown_url`` raised on it in every log line and the consumer's config."""
    from llmgw_common.messages import ClusterSettings
    from llmgw_notifier.targets import webhooks_by_target

    bad = "http://[::1/services/SECRET"
    shown = shown_url(bad)
    assert "SECRET" not in shown and shown.startswith("http://")
    ok = Webhook(url="http://127.0.0.1:9/ok")
    cs = ClusterSettings(webhooks=(Webhook(url=bad), Webhook(url="hooks.example.com/x"), ok))
    with caplog.at_level(logging.WARNING):
        kept = webhooks_by_target(cs)
    assert list(kept.values()) == [ok]
    skipped = [r.getMessage() for r in caplog.records if "skipped" in r.getMessage()]
    assert len(skipped) == 2 and not any("SECRET" in m for m in skipped), skipped
