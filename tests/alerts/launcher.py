"""Run an llmgw service for the alert test on the bus through a URL the test can cut, and (a control
plane) with a fault the test can turn on and off.

    python launcher.py TRIGGER_FILE NATS_URL <llmgw command and arguments...>

``NATS_URL`` replaces the ``--nats`` the chaos harness passes (a proxy of the test's: cut, it leaves this
process alone without the bus). For ``controlplane``: while ``TRIGGER_FILE`` exists every other reconcile
pass raises, as a bug on some input would: the failures are counted (the alert's metric) but never ten
in a row, so the process does not exit 70 and the rest of the cluster goes on being reconciled
(tests/chaos/faults.py has the fault where every pass raises).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any


def arm(trigger: Path) -> None:
    from llmgw_controlplane.scheduler import reconciler, schedule

    real = reconciler.reconcile
    calls = 0

    def reconcile(*a: Any, **kw: Any) -> Any:
        nonlocal calls
        calls += 1
        if calls % 2 == 0 and trigger.exists():
            raise RuntimeError("injected fault: every other reconcile pass raises")
        return real(*a, **kw)

    # The pass's stage calls the name its module imported (as in tests/chaos/faults.py).
    setattr(schedule, "reconcile", reconcile)  # noqa: B010


def with_nats(argv: list[str], url: str) -> list[str]:
    out = list(argv)
    i = out.index("--nats")
    out[i + 1] = url
    return out


if __name__ == "__main__":
    trigger, url, command = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
    if command == "controlplane":
        arm(trigger)
    os.environ["LLMGW_NATS_URLS"] = url
    sys.argv = ["llmgw", *with_nats(sys.argv[3:], url)]
    from llmgw_cli.main import main

    main()
