"""Tenancy's pure parts shared by the CLI and routers: the UTC windows limits count in, and limits as
an operator writes them (``--rpm 60``, ``--model-limit llama:rpm=10,tpm=5000``)."""

from __future__ import annotations

from collections.abc import Iterable
from datetime import UTC, datetime

from llmgw_common.errors import InvalidInput
from llmgw_common.messages import LIMIT_FIELDS, KeyLimits, Limits

MINUTE = 60.0
DAY = 86400.0


def minute_start(now: float) -> float:
    return (now // MINUTE) * MINUTE


def day_start(now: float) -> float:
    # POSIX time has no leap seconds: every UTC day is 86,400 of its seconds.
    return (now // DAY) * DAY


def month_bounds(now: float) -> tuple[float, float]:
    """Start and end (exclusive) of the UTC calendar month holding ``now``."""
    t = datetime.fromtimestamp(now, UTC)
    start = datetime(t.year, t.month, 1, tzinfo=UTC)
    end = datetime(t.year + (t.month == 12), t.month % 12 + 1, 1, tzinfo=UTC)
    return start.timestamp(), end.timestamp()


class LimitsError(InvalidInput):
    """Limits that cannot be used; the message names each problem."""


# The words a --model-limit takes, as the CLI's flags spell them.
_WORDS = {
    "rpm": "rpm",
    "tpm": "tpm",
    "concurrency": "concurrency",
    "daily-tokens": "daily_tokens",
    "daily_tokens": "daily_tokens",
    "monthly-tokens": "monthly_tokens",
    "monthly_tokens": "monthly_tokens",
}


def _count(what: str, text: str) -> int:
    try:
        n = int(text.replace("_", "").replace(",", ""))
    except ValueError:
        raise LimitsError(f"{what}: {text!r} is not a whole number") from None
    if n <= 0:
        raise LimitsError(f"{what}: must be at least 1, got {n} (omit a limit for none)")
    return n


def parse_model_limit(spec: str) -> tuple[str, Limits]:
    """``MODEL:rpm=10,tpm=5000`` -> (model, limits); LimitsError naming what is wrong."""
    model, sep, rest = spec.rpartition(":")
    if not sep or not model or not rest:
        raise LimitsError(f"--model-limit {spec!r}: expected MODEL:rpm=N,tpm=N,...")
    values: dict[str, int] = {}
    for part in rest.split(","):
        word, eq, num = part.strip().partition("=")
        field = _WORDS.get(word.strip().lower())
        if not eq or field is None:
            known = ", ".join(w for w in _WORDS if "_" not in w)
            raise LimitsError(f"--model-limit {spec!r}: {part.strip()!r} is not one of {known} =N")
        if field in values:
            raise LimitsError(f"--model-limit {spec!r}: {word} is given twice")
        values[field] = _count(f"--model-limit {model}: {word}", num.strip())
    return model, Limits(**values)


def build_limits(
    base: KeyLimits | None,
    values: dict[str, int | None],
    model_specs: Iterable[str] = (),
    *,
    clear: Iterable[str] = (),
) -> KeyLimits | None:
    """``base`` with the given limits set (``values``: field -> N, None leaves it), the models of
    ``model_specs`` replaced, and the fields in ``clear`` removed (``clear`` may hold ``models`` too).
    None when nothing is left: unlimited."""
    cur = base.model_dump() if base is not None else {}
    for field in clear:
        if field == "models":
            cur["models"] = {}
        elif field in LIMIT_FIELDS:
            cur[field] = None
        else:
            raise LimitsError(f"--clear: {field!r} is not one of {', '.join((*LIMIT_FIELDS, 'models'))}")
    for field, v in values.items():
        if field not in LIMIT_FIELDS:
            raise LimitsError(f"unknown limit {field!r}")
        if v is not None:
            cur[field] = _count(field, str(v))
    models = dict(cur.get("models") or {})
    for spec in model_specs:
        model, lim = parse_model_limit(spec)
        models[model] = lim.model_dump()
    cur["models"] = models
    out = KeyLimits.model_validate(cur)
    return None if out.empty() else out


def describe(limits: KeyLimits | None) -> str:
    """``rpm=60 tpm=100000 llama:{rpm=10}`` for a table; ``-`` for none."""
    if limits is None or limits.empty():
        return "-"

    def one(lim: Limits) -> str:
        return ",".join(f"{f.replace('_', '-')}={getattr(lim, f)}" for f in LIMIT_FIELDS if getattr(lim, f))

    parts = [one(limits)] if not Limits.empty(limits) else []
    parts += [f"{m}:{one(lim)}" for m, lim in sorted(limits.models.items()) if not lim.empty()]
    return " ".join(parts)
