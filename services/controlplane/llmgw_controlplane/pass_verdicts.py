"""What the last reconcile pass found of the models it could not serve: written by the loop, read by
the ctl service and the console."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class Verdicts:
    """What the last pass found of models it could not serve (ctl replies and the console read them)."""

    # model -> why no placement fits
    unplaceable: dict[str, str] = field(default_factory=dict)
    # model -> its crash loop and when the next attempt is due
    backoff: dict[str, str] = field(default_factory=dict)
    # model -> why it is not routed, in the user's terms (what the routing table says)
    reasons: dict[str, str] = field(default_factory=dict)
