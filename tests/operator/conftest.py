"""Operator tests: whole-system checks of `ctl status`, drain and watched-model alerts.

The process harness of the chaos tests (``tests/chaos/chaos_harness.py``: every service a killable
process) is reused rather than copied; its folder is put on the import path here.
"""

from __future__ import annotations

import sys
from pathlib import Path

_CHAOS = str(Path(__file__).resolve().parent.parent / "chaos")
if _CHAOS not in sys.path:
    sys.path.append(_CHAOS)
