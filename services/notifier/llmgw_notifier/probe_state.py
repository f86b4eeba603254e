"""A watched model's probe state, the transition one probe result makes of it, and the event that
transition is (pure: the wall time is passed in).

``failures`` failures in a row make ``model.down`` once; the next success makes ``model.recovered``
once. As for the control plane, a model is only down once it was up: failures count only after the
model answered a probe or had a ready endpoint (the prober sets ``answered``). A model whose first
replica is still starting is not down, however many probes fail meanwhile.

Event ids are stable, ``model.down:<model>:probe:<episode start, ms>`` (and ``model.recovered:`` with
the same episode), so a retried publish is dropped by JetStream's duplicate window;
``details.source`` (``probe``) tells them from the control plane's (``outages.py`` merges the two).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from llmgw_common.catalog import WatchSpec
from llmgw_common.durations import format_duration
from llmgw_common.event_details import ModelDownDetails, ModelRecoveredDetails, event
from llmgw_common.messages import Event
from llmgw_notifier.formats import utc
from llmgw_notifier.outages import DOWN, PROBE, RECOVERED

SOURCE = PROBE


@dataclass(frozen=True, slots=True)
class ProbeState:
    failures: int = 0  # in a row
    streak_start: float | None = None  # wall time of the first failure of the current streak
    down_since: float | None = None  # set once model.down was emitted: the episode
    last_error: str | None = None
    # The model answered a probe or had a ready endpoint: only then do failures count.
    answered: bool = False


@dataclass(frozen=True, slots=True)
class Transition:
    kind: str  # DOWN or RECOVERED
    episode: float  # the streak's first failure: the same for the down and its recovery


def observe(
    state: ProbeState, ok: bool, now: float, failures_needed: int, error: str | None = None
) -> tuple[ProbeState, Transition | None]:
    """The state after one conclusive probe, and the event it calls for, if any. Failures before the
    model ever answered (its first replica still starting) are not counted: it was never up."""
    if ok:
        if state.down_since is not None:
            return ProbeState(answered=True), Transition(RECOVERED, state.down_since)
        return ProbeState(answered=True), None
    if not state.answered:
        return replace(state, last_error=error), None
    start = state.streak_start if state.streak_start is not None else now
    failures = state.failures + 1
    nxt = replace(state, failures=failures, streak_start=start, last_error=error)
    if state.down_since is None and failures >= failures_needed:
        return replace(nxt, down_since=start), Transition(DOWN, start)
    return nxt, None


def event_id(kind: str, model: str, episode: float) -> str:
    return f"{kind}:{model}:{SOURCE}:{int(episode * 1000)}"


def probe_event(
    model: str,
    tr: Transition,
    state: ProbeState,
    spec: WatchSpec,
    now: float,
    router_url: str,
    base: str | None = None,
) -> Event:
    """``base``: ``model`` is a LoRA adapter of that model (said so in the summary)."""
    what = f"model {model}" if base is None else f"adapter {model} (of model {base})"
    details: ModelDownDetails | ModelRecoveredDetails
    if tr.kind == DOWN:
        details = ModelDownDetails(
            source=SOURCE,
            since=tr.episode,
            budget_s=spec.budget,
            probe_every_s=spec.probe_every,
            router=router_url,
            failures=state.failures,
            last_error=state.last_error,
        )
        summary = (
            f"{what} is not answering: {state.failures} probe(s) in a row failed or took longer than "
            f"{spec.budget:g}s, since {utc(tr.episode)}; last: {state.last_error}"
        )
    else:
        details = ModelRecoveredDetails(
            source=SOURCE,
            since=tr.episode,
            budget_s=spec.budget,
            probe_every_s=spec.probe_every,
            router=router_url,
            down_for_s=max(0.0, now - tr.episode),
        )
        summary = f"{what} answers again (down since {utc(tr.episode)}, {format_duration(now - tr.episode)})"
    return event(details, id=event_id(tr.kind, model, tr.episode), subject=model, time=now, summary=summary)
