"""What `ctl status` / `ctl models` show of a model that follows its load (issue 21): the target, what was
measured, the count it asks for and why, or what holds it; and the events' details."""

from __future__ import annotations

from dataclasses import replace

from llmgw_cli.ctl_render import render_explain, render_models
from llmgw_cli.ctl_scaling import scaling_lines
from llmgw_common.ctl import ModelInfo, ModelsReply, StatusReply
from llmgw_common.event_details import ModelScaledDownDetails, ModelScaledUpDetails
from llmgw_controlplane.scheduler.autoscale import MODEL_SCALED_DOWN, MODEL_SCALED_UP
from llmgw_controlplane.scheduler.placement import explain
from llmgw_controlplane.views import explain_info
from tests.placement.placement_kit import node, snap
from tests.placement.test_loadscale import Fleet, following, reps


def _stepped_up() -> Fleet:
    f = Fleet(following(max_replicas=3, in_flight_per_replica=4.0, up_after=15.0))
    for _ in range(20):
        f.tick(10)
    return f


def test_status_and_models_say_the_target_the_measure_and_the_step() -> None:
    f = _stepped_up()
    info = f.auto.load_info({})["m"]
    assert (info.target, info.replicas, info.wants) == ("in_flight_per_replica 4", 3, 3)
    assert info.why == "waiting for 2 replicas to serve (1 of 3)"
    status = StatusReply.model_validate(f.auto.status({}))
    lines = scaling_lines(status)
    assert "follows load: m 3 replicas (target in_flight_per_replica 4): waiting for 2 replicas" in lines[0]
    models = ModelsReply(models=(ModelInfo(name="m", engine="sim", scaling=info),))
    assert "m follows load (target in_flight_per_replica 4): wants 3; waiting for 2" in render_models(models)


def test_the_step_events_carry_their_reason() -> None:
    f = _stepped_up()
    assert f.events == [MODEL_SCALED_UP]
    ev = f.sent[0]
    d = ModelScaledUpDetails.of(ev)
    assert (d.replicas_from, d.replicas_to, d.target, d.measured, d.for_s) == (
        1,
        3,
        "in_flight_per_replica 4",
        10.0,
        15.0,
    )
    assert d.reason == "10 in flight per replica over 4 for 15s: 1 → 3"
    assert ev.summary == f"model m scaled up: {d.reason}"
    # The down step names the replica it drains.
    for _ in range(15):
        f.tick(10)
    # down_after (300 s) from when the average came under the margin (~26 s after the load went).
    for _ in range(335):
        f.tick(1)
    down = [e for e in f.sent if e.kind == MODEL_SCALED_DOWN]
    assert len(down) == 1
    dd = ModelScaledDownDetails.of(down[0])
    assert (dd.replicas_from, dd.replicas_to) == (3, 2) and dd.replica.startswith("m")
    assert dd.replica in down[0].summary


def test_a_step_that_does_not_fit_says_what_holds_it() -> None:
    # One card: the model asks for 3, placement has room for 1.
    f = Fleet(following(max_replicas=3, in_flight_per_replica=4.0, up_after=5.0))
    f.s = snap([node("n1", n_gpus=1)], reps(1), [f.p], now=f.now)
    for _ in range(10):
        f.tick(10)
    info = f.auto.load_info({"m": "no node has a free H100 (n1: 1 of 1 in use)"})["m"]
    assert info.why.startswith("waiting for 2 replicas to serve (1 of 3); no room: no node has a free H100")
    assert info.why.endswith("would evict nothing known idle")


def test_explain_placement_of_a_model_that_asks_for_more_says_the_step_and_what_stops_it() -> None:
    # One card, the model asks for 3: where the next replica would go is nowhere, and why.
    f = Fleet(following(max_replicas=3, in_flight_per_replica=4.0, up_after=5.0))
    f.s = snap([node("n1", n_gpus=1)], reps(1), [f.p], now=f.now)
    for _ in range(10):
        f.tick(10)
    reply = explain_info(explain(f.p, f.s)).model_copy(update={"scaling": f.auto.explain_scaling("m")})
    assert not reply.placeable
    assert reply.scaling == (
        "follows load (target in_flight_per_replica 4): asks for 3; waiting for 2 replicas to serve (1 of 3)"
    )
    text = render_explain(reply)
    assert text.splitlines()[1] == reply.scaling and "n1" in text
    # With room, the same line above where it would go; a fixed-size model has none.
    f.s = replace(f.s, nodes={"n1": node("n1", n_gpus=8)})
    roomy = explain_info(explain(f.p, f.s))
    assert roomy.placeable and "would go to n1" in roomy.summary
    assert f.auto.explain_scaling("other") == ""
