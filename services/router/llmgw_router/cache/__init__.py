"""KV-cache-aware routing (issue 32): send a request to the replica holding its longest cached prefix.

``index.py`` the exact index (engines' events), ``follower.py`` the bus I/O that feeds it, ``approx.py``
the approximate index (learned from this router's own decisions), ``score.py`` the pure choice,
``tokenizers.py`` where a model's tokenizer comes from, ``router.py`` the facade the request path calls.
Nothing here imports the rest of the router: what it needs of an endpoint is a Protocol (``score.py``).
"""
