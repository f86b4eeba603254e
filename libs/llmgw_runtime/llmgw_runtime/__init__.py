"""llmgw's shared runtime: what every service does the same way and that does I/O.

Connecting to NATS and making its buckets (``bus``), following a bucket (``kv_follower``), a service's
lifecycle and the policy for a loop that dies (``runtime``), stopping a process group (``procgroup``),
running nats-server (``natsserver``), settings (``settings``), the API-key store, the usage ledger and
the ctl client over the bus. The contracts they carry (messages, subjects, codec, catalog, ctl types,
errors) are in ``llmgw_common``, which does no I/O and imports nothing of this package.
"""
