"""The simulated-GPU spec '8xH100-80GB', read one way by the agent (``sim_gpus``) and ``llmgw up``'s fleet file."""

from __future__ import annotations

import re

_SPEC = re.compile(r"^\s*(\d+)\s*[xX]\s*(\S+?)\s*$")
_MEMORY = re.compile(r"-(\d+(?:\.\d+)?)GB$", re.IGNORECASE)


def parse_sim_gpus(spec: str) -> tuple[int, str, int]:
    """(count, class, memory MiB) of a spec like '8xH100-80GB'; ValueError naming what is wrong."""
    m = _SPEC.match(spec)
    if not m:
        raise ValueError(f"sim_gpus {spec!r}: expected '<count>x<CLASS>', e.g. '8xH100-80GB'")
    count, cls = int(m.group(1)), m.group(2)
    mem = _MEMORY.search(cls)
    if not mem:
        raise ValueError(f"sim_gpus {spec!r}: the class must end in its memory, e.g. 'L4-24GB'")
    return count, cls, int(float(mem.group(1)) * 1024)
