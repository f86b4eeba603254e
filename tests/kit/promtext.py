"""Read a Prometheus exposition in tests, through prometheus_client's own parser."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

Labels = tuple[tuple[str, str], ...]


def samples(text: str | bytes) -> dict[tuple[str, Labels], float]:
    """(sample name, sorted labels) -> value for every sample of ``text``."""
    if isinstance(text, bytes):
        text = text.decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def value(text: str | bytes, name: str, **labels: str) -> float | None:
    """The value of one sample, None when ``text`` has no such sample."""
    return samples(text).get((name, tuple(sorted(labels.items()))))


def family_names(text: str | bytes) -> set[str]:
    """Every sample name in ``text`` (``x_total``, ``x_bucket``, ... as a query names them)."""
    return {name for name, _ in samples(text)}
