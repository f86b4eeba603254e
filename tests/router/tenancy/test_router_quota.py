"""Per-key and per-team limits (quota.py) as pure code on a fake clock: each limit, each window's
edges, the refusal's words and headers, the share function, peers' reports."""

from __future__ import annotations

import json
from datetime import UTC, datetime

import msgpack
import pytest

from llmgw_common.codec import decode, encode
from llmgw_common.messages import ApiKeyRecord, KeyLimits, Limits, TeamRecord, UsageHour
from llmgw_common.router_messages import QuotaUse, UsageReport
from llmgw_common.tenancy import LimitsError, build_limits, describe, month_bounds, parse_model_limit
from llmgw_router.errors import RouterError
from llmgw_router.tenancy.keys import KeyTable
from llmgw_router.tenancy.quota import Quotas, Ticket, share


def ts(text: str) -> float:
    return datetime.fromisoformat(text).replace(tzinfo=UTC).timestamp()


def key(
    limits: KeyLimits | None = None, *, kid: str = "k-1", name: str = "alice", team: str | None = None
) -> ApiKeyRecord:
    return ApiKeyRecord(id=kid, name=name, hash="h" + kid, created=0.0, limits=limits, team=team)


def setup(*recs: ApiKeyRecord) -> tuple[KeyTable, Quotas]:
    keys = KeyTable(recs)
    return keys, Quotas(keys, "me", tick_s=1.0)


def admitted(q: Quotas, rec: ApiKeyRecord, now: float, model: str = "m") -> Ticket:
    got = q.admit(rec, model, now)
    assert isinstance(got, Ticket), got.message if isinstance(got, RouterError) else got
    return got


def refused(q: Quotas, rec: ApiKeyRecord, now: float, model: str = "m") -> tuple[RouterError, dict[str, str]]:
    got = q.admit(rec, model, now)
    assert isinstance(got, RouterError), "admitted, expected a refusal"
    assert got.status == 429
    return got, dict(got.headers)


def err(r: RouterError) -> dict[str, str]:
    body: dict[str, dict[str, str]] = json.loads(r.body())
    return body["error"]


def test_rpm_holds_exactly_in_the_utc_minute_and_resets_on_its_edge() -> None:
    rec = key(KeyLimits(rpm=3))
    _, q = setup(rec)
    t0 = ts("2026-12-01T16:00:00")
    for i in range(3):
        admitted(q, rec, t0 + i * 10)
    r, h = refused(q, rec, t0 + 59.999)
    e = err(r)
    assert e["code"] == "rate_limit_exceeded" and e["type"] == "rate_limit_error"
    assert "key 'alice'" in e["message"] and "3 requests per minute" in e["message"]
    assert "2026-12-01T16:01:00Z" in e["message"] and "in 1s" in e["message"]
    assert h["Retry-After"] == "1"
    assert h["x-ratelimit-limit-requests"] == "3" and h["x-ratelimit-remaining-requests"] == "0"
    assert h["x-ratelimit-reset-requests"] == "1s"
    # The next minute starts at 16:01:00 exactly: counted afresh.
    admitted(q, rec, ts("2026-12-01T16:01:00"))
    assert q.meters["k:k-1"].requests == 1


def test_the_refusal_says_when_in_minutes_and_a_refused_request_does_not_count() -> None:
    rec = key(KeyLimits(rpm=1))
    _, q = setup(rec)
    t0 = ts("2026-12-01T16:00:00")
    admitted(q, rec, t0)
    for _ in range(5):
        _, h = refused(q, rec, t0 + 1)
    assert h["Retry-After"] == "59" and h["x-ratelimit-reset-requests"] == "59s"
    m = q.meters["k:k-1"]
    assert m.requests == 1 and m.attempts == 6  # refusals are demand, not use


def test_tpm_counts_prompt_and_completion_when_usage_is_known() -> None:
    rec = key(KeyLimits(tpm=100))
    _, q = setup(rec)
    t0 = ts("2026-12-01T16:00:30")
    admitted(q, rec, t0).release()
    q.add_tokens(rec.id, "m", 99, t0 + 1)
    admitted(q, rec, t0 + 2).release()  # 99 < 100: admitted (a limit is checked at admission)
    q.add_tokens(rec.id, "m", 1, t0 + 3)
    r, h = refused(q, rec, t0 + 4)
    assert "100 tokens per minute" in r.message and h["x-ratelimit-remaining-tokens"] == "0"
    assert h["x-ratelimit-limit-tokens"] == "100" and h["x-ratelimit-reset-tokens"] == "26s"
    assert "x-ratelimit-limit-requests" not in h  # no rpm on this key
    admitted(q, rec, ts("2026-12-01T16:01:00"))


def test_concurrency_is_released_and_then_admits_again() -> None:
    rec = key(KeyLimits(concurrency=2))
    _, q = setup(rec)
    now = ts("2026-12-01T10:00:00")
    a, b = admitted(q, rec, now), admitted(q, rec, now)
    r, h = refused(q, rec, now)
    assert "2 requests in flight" in r.message and h["Retry-After"] == "1"
    assert err(r)["code"] == "rate_limit_exceeded"
    a.release()
    c = admitted(q, rec, now)
    for t in (b, c):
        t.release()
    assert q.meters["k:k-1"].in_flight == 0


def test_a_spent_daily_budget_is_insufficient_quota_until_utc_midnight() -> None:
    rec = key(KeyLimits(daily_tokens=1000))
    _, q = setup(rec)
    morning = ts("2026-12-01T08:00:00")
    admitted(q, rec, morning).release()
    q.add_tokens(rec.id, "m", 1000, morning)
    r, h = refused(q, rec, ts("2026-12-01T23:59:59"))
    e = err(r)
    assert e["code"] == "insufficient_quota"
    assert "daily budget of 1,000 tokens" in e["message"] and "2026-12-02T00:00:00Z" in e["message"]
    assert h["Retry-After"] == "1"
    admitted(q, rec, ts("2026-12-02T00:00:00"))


@pytest.mark.parametrize(
    ("last", "next_"),
    [
        ("2026-12-31T23:59:59", "2027-01-01T00:00:00"),
        ("2028-02-29T23:59:59", "2028-03-01T00:00:00"),  # a leap year's February
        ("2027-02-28T23:59:59", "2027-03-01T00:00:00"),
    ],
)
def test_a_monthly_budget_resets_on_the_first_of_the_utc_month(last: str, next_: str) -> None:
    rec = key(KeyLimits(monthly_tokens=10))
    _, q = setup(rec)
    start, end = month_bounds(ts(last))
    assert end == ts(next_) and start < ts(last)
    admitted(q, rec, start).release()
    q.add_tokens(rec.id, "m", 10, start + 5)
    r, h = refused(q, rec, ts(last))
    assert err(r)["code"] == "insufficient_quota" and "monthly budget of 10 tokens" in r.message
    assert int(h["Retry-After"]) == 1 and next_[:10] in r.message
    admitted(q, rec, ts(next_))


def test_a_model_override_applies_to_its_model_only_and_within_the_overall_limit() -> None:
    rec = key(KeyLimits(rpm=3, models={"big": Limits(rpm=1)}))
    _, q = setup(rec)
    now = ts("2026-12-01T16:00:00")
    admitted(q, rec, now, "big")
    r, _ = refused(q, rec, now, "big")
    assert "key 'alice' for model 'big'" in r.message and "1 requests per minute" in r.message
    admitted(q, rec, now, "small")
    admitted(q, rec, now, "small")
    r, _ = refused(q, rec, now, "small")  # the overall 3: big's 1 + small's 2
    assert "for model" not in r.message


def test_a_team_limit_is_shared_by_its_keys() -> None:
    a = key(kid="k-a", name="a", team="ml")
    b = key(KeyLimits(rpm=10), kid="k-b", name="b", team="ml")
    keys, q = setup(a, b)
    keys.put_team(TeamRecord(name="ml", limits=KeyLimits(rpm=2)))
    now = ts("2026-12-01T16:00:00")
    admitted(q, a, now)
    admitted(q, b, now)
    r, _ = refused(q, a, now)
    assert "team 'ml'" in r.message
    r, _ = refused(q, b, now)
    assert "team 'ml'" in r.message
    # A key whose team has no record is not limited by it.
    c = key(kid="k-c", name="c", team="nobody")
    keys.put(c)
    for _ in range(5):
        admitted(q, c, now)


def test_a_changed_record_takes_effect_on_the_next_request_and_keeps_the_counts() -> None:
    rec = key(KeyLimits(rpm=2))
    keys, q = setup(rec)
    now = ts("2026-12-01T16:00:00")
    held = [admitted(q, rec, now), admitted(q, rec, now)]
    refused(q, rec, now)
    raised = rec.model_copy(update={"limits": KeyLimits(rpm=3)})
    keys.put(raised)
    held.append(admitted(q, raised, now))  # the 3rd this minute
    refused(q, raised, now)
    lifted = rec.model_copy(update={"limits": None})
    keys.put(lifted)
    assert not lifted.limited
    q.tick(now + 1)
    assert "k:k-1" in q.meters  # three requests still hold it
    for t in held:
        t.release()
    q.tick(now + 2)
    assert "k:k-1" not in q.meters


def test_a_record_from_before_tenancy_decodes_as_unlimited() -> None:
    old = {"id": "k-1", "name": "a", "hash": "h", "models": None, "created": 1.0, "expires": None}
    old["revoked"] = False
    rec = decode(msgpack.packb({**old, "_v": 1}), ApiKeyRecord)
    assert rec.limits is None and rec.team is None and rec.weight == 1.0 and not rec.limited
    assert decode(encode(key(KeyLimits(rpm=5))), ApiKeyRecord).limits == KeyLimits(rpm=5)


def test_limits_as_written_are_validated_with_the_problem_named() -> None:
    assert parse_model_limit("llama-3.1-8b:rpm=10,tpm=5_000") == ("llama-3.1-8b", Limits(rpm=10, tpm=5000))
    assert parse_model_limit("org/m:v1:daily-tokens=7")[0] == "org/m:v1"
    for bad, words in (
        ("llama", "expected MODEL:rpm=N"),
        ("llama:rpm=0", "must be at least 1"),
        ("llama:rpm=ten", "not a whole number"),
        ("llama:rps=3", "'rps=3' is not one of"),
        ("llama:rpm=1,rpm=2", "rpm is given twice"),
    ):
        with pytest.raises(LimitsError, match=words):
            parse_model_limit(bad)
    base = build_limits(None, {"rpm": 60}, ["m:tpm=9"])
    assert base == KeyLimits(rpm=60, models={"m": Limits(tpm=9)})
    assert describe(base) == "rpm=60 m:tpm=9"
    assert build_limits(base, {"tpm": 5}, clear=["models"]) == KeyLimits(rpm=60, tpm=5)
    assert build_limits(base, {}, clear=["rpm", "models"]) is None  # nothing left: unlimited
    with pytest.raises(LimitsError, match="must be at least 1"):
        build_limits(None, {"rpm": -1})
    with pytest.raises(LimitsError, match="'speed' is not one of"):
        build_limits(None, {}, clear=["speed"])
    with pytest.raises(ValueError, match="greater than 0"):
        ApiKeyRecord(id="k", name="n", hash="h", created=0.0, weight=0)


# ---------------------------------------------------------------- across routers


def test_share_splits_what_remains_by_demand_in_whole_units_that_sum_to_it() -> None:
    # Three routers holding the same reports: their parts add up to the limit, never more.
    uses = [(10.0, 6.0, "a"), (20.0, 3.0, "b"), (0.0, 1.0, "c")]
    parts = []
    for i, (own, d, rid) in enumerate(uses):
        peers = [u for j, u in enumerate(uses) if j != i]
        parts.append(share(100, own, d, peers, rid))
    assert sum(parts) == 100 and all(p == int(p) for p in parts)
    assert parts[0] - 10 > parts[1] - 20 > parts[2]  # more demand, more of what remains
    assert parts[2] > 0  # no router is starved: the floor
    # 2 left for 3 equal routers: one unit each to the two lowest ids, none more (rounding never
    # admits over the limit, and never strands a unit either).
    split = [share(59, 19, 1, [(19.0, 1.0, o) for o in "abc" if o != me], me) for me in "abc"]
    assert split == [20, 20, 19]
    # No demand anywhere: an equal split of what remains; alone: the whole limit.
    assert share(90, 0, 0, [(30.0, 0.0, "x"), (0.0, 0.0, "y")]) == 20
    assert share(60, 17, 5, []) == 60
    # Over the limit already: nothing more, only what it has.
    assert share(10, 4, 1, [(9.0, 1.0, "x")]) == 4


def _report(router: str, seq: int, uses: dict[str, QuotaUse], since: float = 1.0) -> UsageReport:
    return UsageReport(router=router, since=since, sent_at=0.0, seq=seq, quota=uses)


def test_peers_reports_set_the_share_and_silent_peers_are_forgotten() -> None:
    rec = key(KeyLimits(rpm=90))
    _, q = setup(rec)
    t0 = ts("2026-12-01T16:00:00")
    admitted(q, rec, t0)
    q.tick(t0 + 0.5)
    minute = t0
    # Two peers, each having admitted 40 in this minute and both busy: ours is what is left, shared.
    for name in ("p1", "p2"):
        use = QuotaUse(minute=minute, requests=40, demand=1)
        assert q.on_report(_report(name, 1, {"k:k-1": use}), t0 + 0.6)
    m = q.meters["k:k-1"]
    m.recompute(t0 + 0.6)  # what the next tick does, with our demand of the last tick (1) kept
    assert m.allow[0] == pytest.approx(1 + (90 - 81) / 3)
    for _ in range(3):
        admitted(q, rec, t0 + 0.7)
    refused(q, rec, t0 + 0.7)  # 4 admitted here, our share of 90 - 80
    # A repeat and an older report are dropped; another incarnation (a restart) is taken.
    assert not q.on_report(_report("p1", 1, {}), t0 + 0.8)
    assert not q.on_report(_report("p1", 0, {}), t0 + 0.8)
    assert not q.on_report(_report("me", 9, {}), t0 + 0.8)
    assert q.on_report(_report("p1", 1, {}, since=2.0), t0 + 0.8)  # restarted, nothing counted yet
    assert "p1" not in q.peers["k:k-1"]
    # p2 goes silent: after 3 ticks it is forgotten. p1, live but without use, is still shared with;
    # what both admitted before (p1's earlier incarnation, p2) stays taken until the minute ends.
    q.tick(t0 + 3.5)
    assert "p2" in q.peers["k:k-1"]
    q.tick(t0 + 3.7)
    assert "p2" not in q.peers["k:k-1"] and "p2@1.0" in q.peers["k:k-1"]
    # 6 left: our demand of the last round (4 asked) against p1's none (the floor): all 6 ours.
    assert m.allow[0] == 4 + (90 - 80 - 4)
    q.tick(t0 + 3.9)  # p1 silent too: alone with the rest of the limit
    assert m.allow[0] == 10


def test_a_peer_in_another_window_counts_nothing_in_ours_and_its_rate_is_extrapolated() -> None:
    rec = key(KeyLimits(rpm=100))
    _, q = setup(rec)
    t0 = ts("2026-12-01T16:00:00")
    admitted(q, rec, t0 + 60)
    old = QuotaUse(minute=t0, requests=99, demand=0)
    q.on_report(_report("p", 1, {"k:k-1": old}), t0 + 60.2)
    q.tick(t0 + 60.2)
    # Last minute's 99 are not this minute's: 99 remain, split equally (no demand known): 49.5 each,
    # the odd unit to the lower router id ("me" < "p").
    assert q.meters["k:k-1"].allow[0] == 1 + 50
    cur = QuotaUse(minute=t0 + 60, requests=10, demand=1, tick_requests=20)  # as busy as we were
    q.on_report(_report("p", 2, {"k:k-1": cur}), t0 + 60.2)
    q.tick(t0 + 60.7)  # half a tick since p's report: p is counted at 10 + 20 / 2 = 20
    assert q.meters["k:k-1"].allow[0] == 1 + 40  # 79 left: 39.5 each, the odd unit ours


def test_the_report_carries_what_peers_need_and_nothing_for_idle_meters() -> None:
    rec = key(KeyLimits(rpm=5, daily_tokens=50))
    _, q = setup(rec)
    t0 = ts("2026-12-01T16:00:00")
    t = admitted(q, rec, t0)
    q.add_tokens(rec.id, "m", 7, t0)
    q.tick(t0 + 1)
    use = q.report()["k:k-1"]
    assert (use.requests, use.tokens, use.day_tokens, use.in_flight, use.demand) == (1, 7, 7, 1, 1)
    assert (use.tick_requests, use.tick_tokens, use.minute, use.day) == (1, 7, t0, ts("2026-12-01"))
    t.release()
    q.tick(ts("2026-12-02T00:00:01"))
    assert q.report() == {}  # a new day, nothing counted: peers need not hear of it


def test_a_first_burst_is_shared_with_every_live_router_not_only_those_that_used_the_key() -> None:
    rec = key(KeyLimits(rpm=9))
    _, q = setup(rec)
    t0 = ts("2026-12-01T16:00:00")
    for name in ("p1", "p2"):
        q.on_report(_report(name, 1, {}), t0)  # live, never used this key
    for _ in range(3):
        admitted(q, rec, t0 + 0.1)
    refused(q, rec, t0 + 0.1)  # a third of 9, before any peer has said a word about the key


def test_a_gone_router_s_admissions_still_count_until_its_windows_end() -> None:
    rec = key(KeyLimits(rpm=100))
    _, q = setup(rec)
    t0 = ts("2026-12-01T16:00:00")
    admitted(q, rec, t0)
    q.on_report(_report("p", 1, {"k:k-1": QuotaUse(minute=t0, requests=60, demand=1)}), t0 + 1)
    q.tick(t0 + 1)
    # p is silent past 3 ticks (SIGKILLed): not shared with any more, but its 60 were admitted.
    q.tick(t0 + 4.5)
    m = q.meters["k:k-1"]
    assert "p" not in q._seen and m.allow[0] == pytest.approx(100 - 60)
    # Restarted as a new incarnation: the old one's 60 stay counted, the new one's come on top.
    q.on_report(_report("p", 1, {"k:k-1": QuotaUse(minute=t0, requests=5, demand=0)}, since=9.0), t0 + 5)
    q.tick(t0 + 5)
    assert m.allow[0] == pytest.approx(1 + (100 - 60 - 1 - 5) / 2)
    late = QuotaUse(minute=t0, requests=5, demand=0)  # its last report still of the minute before
    q.on_report(_report("p", 2, {"k:k-1": late}, since=9.0), t0 + 60.2)
    q.tick(t0 + 60.5)  # the next minute: nothing of theirs counts, and the gone one is dropped
    assert m.allow[0] == pytest.approx(100 / 2) and "p@1.0" not in q.peers["k:k-1"]


def test_a_peer_s_allowance_is_taken_until_its_next_tick_and_ours_goes_in_our_report() -> None:
    rec = key(KeyLimits(rpm=100, concurrency=8))
    _, q = setup(rec)
    t0 = ts("2026-12-01T16:00:00")
    q.on_report(_report("p", 1, {}), t0)
    q.tick(t0 + 5)  # p is live; our meter is not young when p reports it
    t = admitted(q, rec, t0 + 5)
    q.tick(t0 + 5.05)  # our demand (1) reported: the weight every router gives us next round
    busy = QuotaUse(minute=t0, requests=5, in_flight=1, demand=1, allow=(60.0, 0.0, 4.0, 0.0, 0.0))
    q.on_report(_report("p", 2, {"k:k-1": busy}), t0 + 5.1)
    q.tick(t0 + 5.2)
    m = q.meters["k:k-1"]
    # p may admit up to 60 before its next tick (not only the 5 it has): 100 - 1 - 60 remain, halved.
    assert m.allow[0] == 1 + 20 and m.allow[2] == 1 + 2  # 8 - 1 - 4 = 3 in flight left: 1.5 each + 1
    assert q.report()["k:k-1"].allow[:3] == (21.0, 0.0, 3.0)  # no tpm: 0 on the wire
    t.release()


def test_a_request_the_router_refused_itself_is_given_back_to_its_minute() -> None:
    rec = key(KeyLimits(rpm=2))
    _, q = setup(rec)
    t0 = ts("2026-12-01T16:00:00")
    refused_by_gate = admitted(q, rec, t0)
    refused_by_gate.release()  # never sent: the model's queue was full, say
    served = admitted(q, rec, t0)
    served.sent = True
    served.release()
    assert q.meters["k:k-1"].requests == 1
    admitted(q, rec, t0 + 1).sent = True
    refused(q, rec, t0 + 2)
    other = key(KeyLimits(rpm=5), kid="k-2", name="bob")
    _, q2 = setup(other)
    late = admitted(q2, other, t0 + 59.9)
    admitted(q2, other, t0 + 60.1).sent = True  # the next minute
    late.release()  # given back only to the minute it was counted in, not this one
    assert q2.meters["k:k-2"].requests == 1


def test_budgets_spent_before_a_start_stay_spent_until_their_window_turns() -> None:
    """load_spent: the ledger's hours of incarnations not heard live count as spent of day and month
    budgets (a restarted router's own former self included); one heard live is counted by its
    reports, not twice; the next UTC day starts afresh for the day budget."""
    rec = key(KeyLimits(daily_tokens=100, monthly_tokens=1000))
    _, q = setup(rec)
    now = ts("2026-12-10T12:00:00")
    live = UsageReport(router="r8", since=7.0, sent_at=now, seq=1)
    assert q.on_report(live, now)
    hours = [
        UsageHour(router="me", since=1.0, hour=now - 3600, written_at=now, usage={"k-1": {"m": (3, 50, 30)}}),
        UsageHour(router="me", since=1.0, hour=now - 86400, written_at=now, usage={"k-1": {"m": (1, 400, 0)}}),
        # Heard live: its reports carry what it spent.
        UsageHour(router="r8", since=7.0, hour=now - 3600, written_at=now, usage={"k-1": {"m": (1, 90, 0)}}),
        UsageHour(router="r7", since=2.0, hour=ts("2026-11-30T10:00:00"), written_at=now, usage={"k-1": {"m": (1, 900, 0)}}),
    ]  # fmt: skip
    q.load_spent(hours, now)
    admitted(q, rec, now).release()
    m = q.meters["k:k-1"]
    # Day: 80 of ours before the restart (r8's 90 not again); month: 480 (r7's November left out).
    assert m._retired()[3:] == [80.0, 480.0]
    q.add_tokens("k-1", "m", 20, now)  # 80 before + 20: the day's 100
    r, _ = refused(q, rec, now + 1)
    assert err(r)["code"] == "insufficient_quota" and "daily budget of 100 tokens" in err(r)["message"]
    # Tomorrow: the day budget is fresh; the month still holds the 480 spent before.
    tomorrow = ts("2026-12-11T00:00:00")
    admitted(q, rec, tomorrow).release()
    assert m._retired()[3:] == [0.0, 480.0]
