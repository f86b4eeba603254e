"""KV-cache-aware routing (issue 32): send a request to the replica holding its longest cached prefix.

```
<prefix>.node.*.kv  KvDeltas ──follower.py──> feeds.py (in order / hold / resync) ──> index.py (exact)
<prefix>.node.<n>.kv-snapshot  <── KvSnapshotRequest, KvSnapshot pages (start, gap, new stream)
object store <prefix>_tokenizers ──tokenizers.py──> one tokenizer per catalog model
request: router.PrefixRouting.prefix (tokens -> block keys) ─> .choose (score.py: cached prefix
         against load, within a bound) ─> .sent (counted; approx.py learns in approximate mode)
```

``service.py`` builds and runs the parts together for the router's wiring. Nothing here imports the rest
of the router: what it needs of an endpoint is a Protocol (``score.Candidate``).
"""
