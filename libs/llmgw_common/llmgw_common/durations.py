"""Human durations ("30s", "10m", "1h30m", "30d") to seconds and back."""

from __future__ import annotations

import re

_PART = re.compile(r"(\d+(?:\.\d+)?)(ms|s|m|h|d|w)")
_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0, "w": 604800.0}


def parse_duration(value: str | float | int) -> float:
    """Seconds from a number or a string like ``90s``, ``10m``, ``1h30m``; ValueError otherwise."""
    if isinstance(value, bool):
        raise ValueError(f"not a duration: {value!r}")
    if isinstance(value, int | float):
        if value < 0:
            raise ValueError(f"duration must not be negative: {value}")
        return float(value)
    text = value.strip().lower()
    try:
        return parse_duration(float(text))
    except ValueError:
        pass
    pos, total = 0, 0.0
    for m in _PART.finditer(text):
        if m.start() != pos:
            break
        total += float(m.group(1)) * _UNITS[m.group(2)]
        pos = m.end()
    if pos != len(text) or not text:
        raise ValueError(f"not a duration: {value!r} (use e.g. 30s, 10m, 2h, 30d)")
    return total


def format_duration(seconds: float) -> str:
    """Compact human form: ``45s``, ``12m``, ``3h5m``, ``2d4h``."""
    s = max(0, int(seconds))
    if s < 60:
        return f"{s}s"
    m, s = divmod(s, 60)
    if m < 60:
        return f"{m}m" + (f"{s}s" if s and m < 10 else "")
    h, m = divmod(m, 60)
    if h < 24:
        return f"{h}h" + (f"{m}m" if m else "")
    d, h = divmod(h, 24)
    return f"{d}d" + (f"{h}h" if h else "")
