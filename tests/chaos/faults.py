"""Run an llmgw command with a fault armed: it fires once a trigger file exists (chaos tests).

    python faults.py FAULT TRIGGER_FILE <llmgw arguments...>

Faults: ``reconcile-raises`` (every control-plane reconcile pass raises, as a bug on some input
would), ``router-tick-ends`` (the router's tick loop returns, as a loop ended by a bug would).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any


def arm(fault: str, trigger: Path) -> None:
    if fault == "reconcile-raises":
        from llmgw_controlplane.scheduler import reconciler, schedule

        real = reconciler.reconcile

        def reconcile(*a: Any, **kw: Any) -> Any:
            if trigger.exists():
                raise RuntimeError("injected fault: reconcile raises")
            return real(*a, **kw)

        # The pass's stage calls the name its module imported: replace it there (by setattr: mypy refuses
        # to assign a name the module does not export).
        setattr(schedule, "reconcile", reconcile)  # noqa: B010
    elif fault == "router-tick-ends":
        from llmgw_router.service import Router

        real_tick = Router._tick

        async def _tick(self: Router) -> None:
            import asyncio
            import contextlib

            ticking = asyncio.create_task(real_tick(self))
            while not await asyncio.to_thread(trigger.exists):
                await asyncio.sleep(0.05)
            ticking.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await ticking
            # and return: the loop is over

        setattr(Router, "_tick", _tick)  # noqa: B010 (assigning a method is what mypy refuses)
    else:
        raise SystemExit(f"unknown fault {fault!r}")


def launcher(fault: str, trigger: Path) -> list[str]:
    """The argv head that runs an llmgw command with ``fault`` armed."""
    return [sys.executable, str(Path(__file__).resolve()), fault, str(trigger)]


if __name__ == "__main__":
    arm(sys.argv[1], Path(sys.argv[2]))
    sys.argv = ["llmgw", *sys.argv[3:]]
    from llmgw_cli.main import main

    main()
