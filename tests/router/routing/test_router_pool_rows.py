"""``Pool.set_models`` (a router applying only the rows that changed, issue 35) against the oracle it
replaces, ``Pool.set_endpoints`` of the whole table: after every step of random row changes the two
pools hold the same endpoints, maps, states and reasons, and withdraw the same endpoints; live state
(in-flight counts) outlives a change to another model."""

from __future__ import annotations

import random

import pytest

from llmgw_common.messages import Endpoint
from llmgw_common.routing_table import ModelRouting, RowFold
from llmgw_router.routing.endpoints import Pool


def _row(rng: random.Random, model: str, version: int) -> ModelRouting:
    eps = tuple(
        Endpoint(
            replica_id=f"{model}-r{i}",
            model=model,
            url=f"http://10.0.{i}.{rng.randrange(3)}:8000",
            node=f"node-{rng.randrange(6)}",
            draining=rng.random() < 0.2,
        )
        for i in sorted(rng.sample(range(6), rng.randrange(4)))
    )
    return ModelRouting(
        version=version,
        model=model,
        endpoints=eps,
        unavailable=None if eps else rng.choice([None, "needs 8 x H100, 0 free"]),
        coming=rng.choice([None, None, "replica starting"]),
        cold=rng.random() < 0.1,
    )


def _state(p: Pool) -> tuple[object, ...]:
    return (
        sorted(p.by_key),
        {m: sorted(e.key for e in eps) for m, eps in p.by_model.items() if eps},
        {r: sorted(e.key for e in eps) for r, eps in p.by_replica.items()},
        sorted(p.by_tag),
        sorted(p.ready),
        dict(p.unavailable),
        dict(p.coming),
        sorted(p.cold),
        {k: (e.draining, e.node) for k, e in p.by_key.items()},
    )


@pytest.mark.slow
def test_set_models_agrees_with_the_whole_table_at_every_step() -> None:
    for seed in range(20):
        rng = random.Random(seed)
        models = [f"m{i}" for i in range(8)]
        fold = RowFold()
        rows_pool, whole_pool = Pool(), Pool()
        for step in range(1, 60):
            for m in rng.sample(models, rng.randrange(1, 4)):
                if rng.random() < 0.15:
                    fold.drop(m)
                else:
                    fold.put(_row(rng, m, step))
            whole, changed = fold.take()
            table = fold.table()
            expected = {e.key for e in whole_pool.set_endpoints(table)}
            if whole:
                got = {e.key for e in rows_pool.set_endpoints(table)}
            else:
                got = {
                    e.key for e in rows_pool.set_models({m: fold.rows.get(m) for m in changed}, fold.version)
                }
            assert got == expected, (seed, step)
            assert _state(rows_pool) == _state(whole_pool), (seed, step)
            assert rows_pool.table_read and rows_pool.endpoints_version == fold.version


def test_a_change_to_one_model_keeps_the_live_state_of_the_others() -> None:
    fold = RowFold()
    a = Endpoint(replica_id="ra", model="a", url="http://10.0.0.1:8000", node="n1")
    b = Endpoint(replica_id="rb", model="b", url="http://10.0.0.2:8000", node="n2")
    fold.put(ModelRouting(version=1, model="a", endpoints=(a,)))
    fold.put(ModelRouting(version=1, model="b", endpoints=(b,)))
    pool = Pool()
    assert fold.take()[0]
    pool.set_endpoints(fold.table())
    pool.by_model["a"][0].in_flight = 3
    fold.put(ModelRouting(version=2, model="b", endpoints=()))
    whole, changed = fold.take()
    assert not whole and changed == {"b"}
    withdrawn = pool.set_models({m: fold.rows.get(m) for m in changed}, fold.version)
    assert [e.replica_id for e in withdrawn] == ["rb"]
    assert pool.by_model["a"][0].in_flight == 3 and "b" not in pool.by_model and pool.ready == {"a"}
    assert "rb" not in pool.by_replica and pool.endpoints_version == 2
