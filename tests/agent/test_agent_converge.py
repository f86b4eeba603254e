"""plan_converge: the pure decision of what to start, stop, adopt and refuse."""

from __future__ import annotations

import hashlib

from llmgw_agent.converge import Running, Wanted, assignment_fingerprint, plan_converge
from llmgw_agent.engines import LaunchSpec, Refusal
from llmgw_agent.metrics import VLLM_METRICS
from llmgw_common.messages import ShardAssignment


def spec(tag: str) -> LaunchSpec:
    return LaunchSpec(argv=("engine", tag), env={}, health_url=None, metrics_url=None, metrics=VLLM_METRICS)


def run(fp: str) -> Wanted:
    return Wanted(fp, spec(fp))


A, B, C = ("a", 0), ("b", 0), ("c", 1)
NO_GPU = "vLLM needs a GPU"


def test_assignment_fingerprint_follows_the_assignment() -> None:
    a = ShardAssignment(replica_id="r", shard=0, model="m", engine="sim", port=1)
    assert assignment_fingerprint(a) == assignment_fingerprint(a.model_copy())
    assert assignment_fingerprint(a) != assignment_fingerprint(a.model_copy(update={"port": 2}))


def test_start_new_and_stop_unassigned() -> None:
    p = plan_converge({A: run("1")}, {B: Running("2")}, {})
    assert (p.start, p.stop, p.adopt, p.refuse, p.stop_orphans) == ([A], [B], [], [], [])


def test_same_assignment_is_left_alone_even_if_the_command_or_weights_changed() -> None:
    # Failed or ready, an engine of this very assignment is not restarted by the agent.
    assert plan_converge({A: run("1")}, {A: Running("1")}, {}).empty
    # The node now refuses it (weights gone): a running engine keeps running.
    assert plan_converge({A: Wanted("1", Refusal(NO_GPU))}, {A: Running("1")}, {}).empty


def test_changed_assignment_restarts() -> None:
    p = plan_converge({A: run("new")}, {A: Running("old")}, {})
    assert (p.stop, p.start) == ([A], [A])


def test_adopt_when_still_assigned_with_same_assignment_else_stop_orphan() -> None:
    p = plan_converge({A: run("1"), B: run("2")}, {}, {A: "1", B: "changed", C: "3"})
    assert p.adopt == [A]
    assert p.stop_orphans == [B, C]
    assert p.start == [B]


def test_refusal_recorded_once_then_replaced_when_it_no_longer_holds() -> None:
    r = Wanted("1", Refusal(NO_GPU))
    assert plan_converge({A: r}, {}, {}).refuse == [A]
    assert plan_converge({A: r}, {A: Running("1", refused=NO_GPU)}, {}).empty
    # Another reason now: the record is replaced.
    p = plan_converge({A: Wanted("1", Refusal("other"))}, {A: Running("1", refused=NO_GPU)}, {})
    assert (p.stop, p.refuse) == ([A], [A])
    # Refused before, runnable now (the weights arrived): the failed record goes and the engine starts.
    p2 = plan_converge({A: run("1")}, {A: Running("1", refused=NO_GPU)}, {})
    assert (p2.stop, p2.start) == ([A], [A])
    # A changed assignment that this node refuses replaces the running engine.
    p3 = plan_converge({A: Wanted("2", Refusal(NO_GPU))}, {A: Running("1")}, {})
    assert (p3.stop, p3.refuse) == ([A], [A])


def test_adoptable_refused_or_already_running_is_stopped_not_adopted() -> None:
    p = plan_converge({A: run("1")}, {A: Running("1")}, {A: "1"})
    assert (p.adopt, p.stop_orphans, p.start) == ([], [A], [])
    p2 = plan_converge({A: Wanted("1", Refusal(NO_GPU))}, {}, {A: "1"})
    assert (p2.adopt, p2.stop_orphans, p2.refuse) == ([], [A], [A])


def test_a_field_added_later_changes_no_running_shards_fingerprint() -> None:
    from llmgw_agent.converge import assignment_fingerprint
    from llmgw_common.catalog import CacheRouting
    from llmgw_common.messages import ShardAssignment

    a = ShardAssignment(replica_id="r1", shard=0, model="m", engine="sim", port=9000)
    # The fingerprint an agent from before ``cache_routing`` (and LoRA's fields) computed: the dump
    # without those fields.
    later = {"cache_routing", "max_loras", "max_lora_rank", "max_cpu_loras", "adapters"}
    before = hashlib.sha256(a.model_dump_json(exclude=later).encode()).hexdigest()[:16]
    assert assignment_fingerprint(a) == before
    off = a.model_copy(update={"cache_routing": CacheRouting.OFF})
    assert assignment_fingerprint(off) != before  # set, it is asked of the shard: the engine follows
