"""The control plane's scheduler: pure decisions over a snapshot, the time passed in, no I/O (issue 23).

Everything here is a function of what it is given (a :class:`~.snapshot.Snapshot`, the memo of the
last pass, the books of routers' reports, ``now``): it decides, and only the runtime around it (the
reconcile loop, the lease, ingest, the writers, the responders: the rest of ``llmgw_controlplane``)
talks to NATS. The import-linter contract "The control plane's decisions do no I/O" (pyproject.toml)
keeps this package from importing ``nats``, ``asyncio``, ``llmgw_runtime.bus`` or those runtime modules.

One pass is ``schedule.schedule(snapshot, memo, inputs, policy)``; what it remembers for the next is
one ``SchedulerMemo``. Its stages, in order:

1. ``scaling`` (scale to zero by idleness, from ``idle``; back up on a wake) and ``loadscale``
   (following the load, from ``demand``): each scaling model's wanted count.
2. ``reconciler`` (``reconcile``; per model ``reconcile_model``, in one pass's state ``reconcile_pass``,
   ports from ``ports``) over ``snapshot``, each replica's phase judged once by ``phase``
   (``replica_status``; routed or not: ``serving``), placing with ``placement`` (``place``: where a
   replica fits, and why not): the ``plan`` (place, stop, drain, unplaceable, backoff).
3. ``drains``: a stop of a replica that still serves waits until routers hold nothing on it.
4. ``eviction`` (``make_room``): stops that make room for what placement could not place; its room is
   placed on the next pass.

Beside the pass: ``routing`` (the routing table's content from the snapshot and the plan's reasons),
``autoscale`` (``Autoscaler``: the wakes and demand a pass reads, what it decided, for ``ctl status``
and events), ``wake_decisions`` (``WakeBook``, ``wake_answer``) and ``event_detection``
(``EventDetector``: the transitions the runtime publishes as events).
"""
