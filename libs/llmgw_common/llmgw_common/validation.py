"""Validating an operator's document (catalog, fleet file, static file) so that every problem is listed.

A document is YAML read through :func:`load_yaml`'s limits, a mapping at the top, and lists of named
entries. Each entry is validated on its own, so one bad entry does not hide the problems of the next;
the caller's checks add what pydantic cannot know, and duplicate names are reported with both
positions. Every refusal is a :class:`ProblemsError` naming the document and listing every problem.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import yaml
from pydantic import BaseModel, ValidationError

from llmgw_common.errors import InvalidInput
from llmgw_common.yamlsafe import load_yaml

M = TypeVar("M", bound=BaseModel)


class ProblemsError(InvalidInput):
    """A document refused; ``problems`` lists every reason. Subclasses set ``document``."""

    document = "document"

    def __init__(self, problems: list[str]) -> None:
        self.problems = problems
        super().__init__(f"invalid {self.document}:\n" + "\n".join(f"  - {p}" for p in problems))


def read_document(path: str, error: type[ProblemsError]) -> str:
    """The text of the file at ``path``; ``error`` says why it cannot be read."""
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except OSError as e:
        raise error([f"cannot read {path}: {e.strerror}"]) from None


def document_mapping(data: Any, error: type[ProblemsError], shape: str) -> dict[Any, Any]:
    """YAML text (or what it already parsed to) as the mapping at a document's top.

    ``shape`` tells the operator what the top should be ("a catalog is a mapping with a 'models'
    list"); an empty document is an empty mapping.
    """
    if isinstance(data, str | bytes):
        try:
            data = load_yaml(data)
        except yaml.YAMLError as e:
            raise error([f"not valid YAML: {e}"]) from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise error([shape])
    return data


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
