"""The book of failed replicas: what is kept, for how long, how much (issue 12 item 15). Times are data."""

from __future__ import annotations

from llmgw_common.ctl import ModelInfo
from llmgw_common.messages import ReplicaRecord, ShardPlacement, ShardState, ShardStatus
from llmgw_controlplane.failures import LINE_CHARS, TAIL_LINES, FailureBook, failed_replica
from llmgw_controlplane.state import ClusterState


def _state_with_failed_shard(tail: tuple[str, ...]) -> tuple[ClusterState, ReplicaRecord]:
    st = ClusterState(heartbeat_interval_s=2.0, unreachable_after_missed=3, node_lost_s=30.0)
    rec = ReplicaRecord(
        id="m-1", model="m", created=10.0, shards=(ShardPlacement(shard=0, node="n1", gpus=(3,), port=20001),)
    )
    st.put_replica(rec)
    st.on_status(
        ShardStatus(
            node="n1",
            boot_id="b1",
            sent_at=11.0,
            replica_id="m-1",
            shard=0,
            model="m",
            state=ShardState.FAILED,
            port=20001,
            error="exited with code 2",
            log_tail=tail,
        ),
        11.0,
    )
    return st, rec


def test_a_failed_replica_keeps_its_shards_errors_and_a_clipped_log_tail() -> None:
    tail = tuple(f"line {i} " + "x" * 500 for i in range(50))
    st, rec = _state_with_failed_shard(tail)
    info = failed_replica(st, rec, "failed: shard 0 on n1: exited with code 2", now=12.0)
    assert (info.id, info.model, info.state, info.failed_at) == ("m-1", "m", "failed", 12.0)
    assert info.error == "shard 0 on n1: exited with code 2"
    (sh,) = info.shards
    assert (sh.node, sh.gpus, sh.port, sh.state, sh.error) == (
        "n1",
        (3,),
        20001,
        "failed",
        "exited with code 2",
    )
    assert len(sh.log_tail) == TAIL_LINES and sh.log_tail[-1].startswith("line 49 ")
    assert all(len(line) == LINE_CHARS for line in sh.log_tail)


def test_book_keeps_the_newest_per_replica_and_per_model_for_the_retention_only() -> None:
    st, rec = _state_with_failed_shard(("boom",))
    book = FailureBook(retention_s=60.0, max_kept=3)
    for i, (rid, model) in enumerate([("a-1", "a"), ("b-1", "b"), ("a-2", "a"), ("c-1", "c")]):
        info = failed_replica(st, rec, "failed: boom", now=100.0 + i)
        book.add(info.model_copy(update={"id": rid, "model": model}))
    # Bounded: the oldest of four is gone; newest first.
    assert [f.id for f in book.replicas(110.0)] == ["c-1", "a-2", "b-1"]
    assert [f.id for f in book.replicas(110.0, model="a")] == ["a-2"]
    last_a = book.last("a", 110.0)
    assert last_a is not None and last_a.id == "a-2"
    models = book.on_models([ModelInfo(name="a", engine="sim"), ModelInfo(name="z", engine="sim")], 110.0)
    assert models[0].last_failure == last_a and models[1].last_failure is None
    # b-1 failed at 101: still there at 160.9, gone at 161; the newer ones stay a little longer.
    assert "b-1" in {f.id for f in book.replicas(160.9)}
    assert [f.id for f in book.replicas(161.0)] == ["c-1", "a-2"]
    assert book.last("b", 161.0) is None
    assert book.replicas(163.0) == () and book.last("c", 163.0) is None
