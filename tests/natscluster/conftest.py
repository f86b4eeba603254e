"""NATS cluster tests: three nats-servers, the llmgw services on R3 buckets, one server killed.

The process harness of the chaos tests (``tests/chaos/chaos_harness.py``) is reused rather than
copied; its folder is put on the import path here.
"""

from __future__ import annotations

import sys
from pathlib import Path

_CHAOS = str(Path(__file__).resolve().parent.parent / "chaos")
if _CHAOS not in sys.path:
    sys.path.append(_CHAOS)
