"""Stand-ins for a task caught in Python 3.11's lost-cancel bug (CPython gh-86296).

``asyncio.wait_for``, inside nats-py's request, flush and JetStream calls, drops a cancel that lands
as its answer arrives: the task goes on. A stop that cancels once and then awaits such a task waits
for ever; ``llmgw_runtime.runtime.cancel_and_wait`` is the cure, and these are how tests show it.
"""

from __future__ import annotations

import asyncio
import io


async def swallows_one_cancel() -> None:
    """Run until cancelled twice: the first cancel is dropped, as 3.11's wait_for drops it."""
    try:
        await asyncio.sleep(3600)
    except asyncio.CancelledError:
        pass  # what wait_for does when its answer and the cancel arrive together
    while True:
        await asyncio.sleep(3600)


def task_stacks() -> str:
    """Every task of the running loop with where it waits: what a test prints when a stop hangs."""
    out = io.StringIO()
    for t in asyncio.all_tasks():
        out.write(f"--- {t!r}\n")
        t.print_stack(file=out)
    return out.getvalue()
