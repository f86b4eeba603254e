"""The control plane's scheduler: pure decisions over a snapshot, the time passed in, no I/O (issue 23).

Everything here is a function of what it is given (a :class:`~.snapshot.Snapshot`, the memo of the
last pass, the books of routers' reports, ``now``): it decides, and only the runtime around it (the
reconcile loop, the lease, ingest, the writers, the responders: the rest of ``llmgw_controlplane``)
talks to NATS. The import-linter contract "The control plane's decisions do no I/O" (pyproject.toml)
keeps this package from importing ``nats``, ``asyncio``, ``llmgw_runtime.bus`` or those runtime modules.

The pipeline, in the order a pass runs it:

1. ``snapshot``: the immutable view of the cluster a pass decides over (nodes, GPUs, replicas, catalog).
2. ``phase``: each replica's phase (``replica_status``) and whether it is routed (``serving``), judged
   once per snapshot.
3. ``reconciler`` (``reconcile``; per model ``reconcile_model``, in one pass's state ``reconcile_pass``,
   ports from ``ports``) and ``placement`` (``place``: where a replica fits, and why not).
4. ``plan``: what the pass decided (place, stop, drain, unplaceable, backoff) and its memo; ``routing``:
   the routing table's content from the snapshot and the reconciler's reasons.

Scaling, beside it: ``scaling`` (scale to zero by idleness, from ``idle``), ``loadscale`` (following the
load, from ``demand``), ``eviction`` (what to stop so a wanted replica fits) and ``autoscale`` (the
memo, wakes and evictions across passes).

Wakes and events: ``wake_decisions`` (``WakeBook``, ``wake_answer``) and ``event_detection``
(``EventDetector``: the transitions the runtime publishes as events).
"""
