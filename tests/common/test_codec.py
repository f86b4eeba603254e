from __future__ import annotations

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from llmgw_common.catalog import Catalog, ModelProfile
from llmgw_common.codec import SCHEMA_VERSION, DecodeError, decode, encode
from llmgw_common.messages import (
    Assignment,
    Endpoint,
    GpuInfo,
    Heartbeat,
    Inventory,
    RoutingCatalog,
    RoutingEndpoints,
    ShardAssignment,
    ShardReport,
    ShardState,
    StorageReport,
    WeightsEntry,
)
from llmgw_common.router_messages import IdleReport


def test_round_trip_keeps_every_field() -> None:
    inv = Inventory(
        node="n1",
        boot_id="b",
        sent_at=1.5,
        gpus=(
            GpuInfo(
                index=0,
                uuid="u",
                name="H100",
                gpu_class="H100-80GB",
                memory_mb=81920,
                healthy=False,
                reasons=("XID 79 seen",),
            ),
        ),
        memory_gb=None,
        labels={"role": "coding"},
        fabric="ib-a",
        storage=StorageReport(
            looked=True, weights=(WeightsEntry(name="m", path="/m", shared=True, filer_id="f:/x"),)
        ),
    )
    assert decode(encode(inv), Inventory) == inv
    hb = Heartbeat(
        node="n1",
        boot_id="b",
        seq=3,
        sent_at=2.0,
        shards=(ShardReport(replica_id="r", shard=0, model="m", state=ShardState.READY),),
    )
    assert decode(encode(hb), Heartbeat) == hb
    cat = RoutingCatalog(version=2, catalog=Catalog(models=(ModelProfile(name="m", engine="sim"),)))
    assert decode(encode(cat), RoutingCatalog) == cat
    ep = RoutingEndpoints(
        version=1, endpoints={"m": (Endpoint(replica_id="r", model="m", url="http://x", node="n"),)}
    )
    assert decode(encode(ep), RoutingEndpoints) == ep
    a = Assignment(
        node="n",
        fence=4,
        shards=(ShardAssignment(replica_id="r", shard=0, model="m", engine="sim", port=20001, gpus=(0, 1)),),
    )
    assert decode(encode(a), Assignment) == a


def test_unknown_fields_are_ignored() -> None:
    raw = {
        "_v": SCHEMA_VERSION,
        "router": "r",
        "since": 1.0,
        "sent_at": 2.0,
        "last_used": {},
        "future": [1, 2],
    }
    assert decode(msgpack.packb(raw), IdleReport).router == "r"


def test_none_is_not_zero_after_a_round_trip() -> None:
    inv = Inventory(node="n", boot_id="b", sent_at=0.0, memory_gb=None)
    assert decode(encode(inv), Inventory).memory_gb is None


@pytest.mark.parametrize(
    "payload, fragment",
    [
        (b"", "not msgpack"),
        (b"\xc1", "not msgpack"),
        (msgpack.packb([1, 2]), "expected a map"),
        (msgpack.packb({"node": "n"}), "schema version None"),
        (msgpack.packb({"_v": 99, "node": "n"}), "schema version 99"),
        (msgpack.packb({"_v": SCHEMA_VERSION, "node": "n"}), "boot_id"),
        (
            msgpack.packb({"_v": SCHEMA_VERSION, "node": 5, "boot_id": "b", "seq": "x", "sent_at": 1.0}),
            "problem",
        ),
        (b"\x00" * (9 * 1024 * 1024), "exceeds"),
    ],
)
@pytest.mark.slow
def test_bad_payloads_raise_the_one_error(payload: bytes, fragment: str) -> None:
    with pytest.raises(DecodeError) as e:
        decode(payload, Heartbeat)
    assert fragment in str(e.value)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=512))
def test_any_bytes_decode_or_raise_decode_error(data: bytes) -> None:
    try:
        decode(data, Heartbeat)
    except DecodeError:
        pass


_json = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats(allow_nan=False)
    | st.text(max_size=8),
    lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=6), c, max_size=4),
    max_leaves=12,
)


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(st.sampled_from(["_v", "node", "boot_id", "seq", "sent_at", "shards", "x"]), _json))
@pytest.mark.slow
def test_any_map_decodes_or_raises_decode_error(d: dict[str, object]) -> None:
    try:
        hb = decode(msgpack.packb(d), Heartbeat)
    except DecodeError:
        return
    assert isinstance(hb, Heartbeat)
