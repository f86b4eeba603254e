"""A router's demand report as it goes on the bus: what changed since the last, in bounded messages.

:class:`~llmgw_router.demand.DemandMeter` builds the whole report each tick, one entry per model; at
~290 bytes an entry, 5,000 models made 1.45 MB, past NATS's 1 MB ``max_payload``: the publish failed,
every tick (bench/RESULTS.md, issue 35). Most entries do not change from one tick to the next (a model
nobody calls reports zeros), so :class:`DemandDeltas` sends:

- each tick, the entries that changed since the last sent, and the models no longer reported (``gone``);
  a ``window_s`` or ``rate_s`` that moved by less than :data:`SECONDS_SAME` is no change (they follow
  the tick's own jitter);
- every :data:`WHOLE_EVERY_S`, whenever the router restarted, and when a control plane that has just
  started asks (:meth:`ask_whole`), every entry, the first message saying
  ``whole`` (the receiver starts the router's view anew): a lost message is made good by then;
- at most :data:`MAX_MODELS_PER_MESSAGE` entries a message, in as many messages as it takes, the same
  ``sent_at`` on each.

At least one message a tick, empty when nothing changed: the control plane forgets a silent router. The
entries count as sent only once every message of the tick was published (:meth:`sent`): a tick that
failed is sent again, changes and all. Pure: the time comes in as arguments.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from llmgw_common.router_messages import DemandReport, ModelDemand

# A whole report this often; a lost delta is wrong at most this long.
WHOLE_EVERY_S = 60.0
# Entries a message, ~290 bytes each (more with a cache entry): ~150-250 KB, well under 1 MB.
MAX_MODELS_PER_MESSAGE = 500
# Seconds a window or rate base may move before the entry counts as changed.
SECONDS_SAME = 0.5


def same(a: ModelDemand | None, b: ModelDemand) -> bool:
    """``b`` tells the control plane nothing ``a`` did not."""
    if a is None:
        return False
    if abs(a.window_s - b.window_s) >= SECONDS_SAME or abs(a.rate_s - b.rate_s) >= SECONDS_SAME:
        return False
    return a.model_copy(update={"window_s": b.window_s, "rate_s": b.rate_s}) == b


@dataclass
class DemandDeltas:
    whole_every_s: float = WHOLE_EVERY_S
    max_models: int = MAX_MODELS_PER_MESSAGE
    # What the receiver holds of this router: the entries last sent, and the incarnation they are of.
    held: dict[str, ModelDemand] = field(default_factory=dict)
    since: float | None = None
    whole_at: float = float("-inf")

    def messages(self, rep: DemandReport) -> list[DemandReport]:
        """The messages that bring the receiver from what it holds to ``rep``, in order."""
        whole = self.since != rep.since or rep.sent_at - self.whole_at >= self.whole_every_s
        if whole:
            changed, gone = rep.models, []
        else:
            changed = {m: d for m, d in rep.models.items() if not same(self.held.get(m), d)}
            gone = sorted(m for m in self.held if m not in rep.models)
        names = sorted(changed)
        out: list[DemandReport] = []
        for start in range(0, max(len(names), 1), self.max_models):
            part = {m: changed[m] for m in names[start : start + self.max_models]}
            first = start == 0
            out.append(
                rep.model_copy(
                    update={"models": part, "whole": whole and first, "gone": gone if first else []}
                )
            )
        return out

    def ask_whole(self) -> None:
        """A control plane asked (it has just started and holds no view): the next tick sends all."""
        self.whole_at = float("-inf")

    def sent(self, messages: list[DemandReport]) -> None:
        """Every one of ``messages`` (one tick's) was published: the receiver holds them now."""
        for m in messages:
            if m.whole:
                self.held = {}
                self.since = m.since
                self.whole_at = m.sent_at
            for name in m.gone:
                self.held.pop(name, None)
            self.held.update(m.models)
