"""Validating a list of named entries (catalog models, fleet nodes) so that every problem is listed.

Each entry is validated on its own, so one bad entry does not hide the problems of the next; the
caller's checks add what pydantic cannot know, and duplicate names are reported with both positions.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

M = TypeVar("M", bound=BaseModel)


def describe(label: str, err: ValidationError) -> list[str]:
    """One line per pydantic error, in the user's words: ``label: field: what is wrong``."""
    out = []
    for e in err.errors():
        loc = ".".join(str(x) for x in e["loc"])
        msg = "unknown field" if e["type"] == "extra_forbidden" else e["msg"].removeprefix("Value error, ")
        out.append(f"{label}: {loc}: {msg}" if loc else f"{label}: {msg}")
    return out


def validate_named(
    raw: list[Any], cls: type[M], *, kind: str, list_name: str, checks: Callable[[M], list[str]]
) -> tuple[list[M], list[str]]:
    """Every entry of ``raw`` that validates as ``cls``, and every problem found in any of them.

    ``kind`` names one entry in messages ("model", "node"); ``list_name`` is the list's key, used for
    positions ("models[3]"). Entries must have a ``name``.
    """
    items: list[M] = []
    problems: list[str] = []
    seen: dict[str, int] = {}
    for i, entry in enumerate(raw):
        label = f"{list_name}[{i}]"
        if isinstance(entry, dict) and isinstance(entry.get("name"), str):
            label = f"{kind} {entry['name']!r}"
        try:
            item = cls.model_validate(entry)
        except ValidationError as e:
            problems.extend(describe(label, e))
            continue
        problems.extend(checks(item))
        name = getattr(item, "name")  # noqa: B009 - every entry kind has a name; M is bound to BaseModel
        if name in seen:
            problems.append(f"{label}: duplicate name (also {list_name}[{seen[name]}])")
        else:
            seen[name] = i
        items.append(item)
    return items, problems
