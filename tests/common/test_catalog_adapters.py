"""LoRA adapters in the catalog (issue 33): validated with the whole catalog; never part of a replica's spec."""

from __future__ import annotations

import pytest

from llmgw_agent.converge import assignment_fingerprint
from llmgw_common.catalog import Catalog, CatalogError, catalog_to_yaml, parse_catalog
from llmgw_common.codec import decode, encode
from llmgw_common.messages import AdapterLoad, ReplicaLoad, ReplicaSpec, ShardAssignment

GOOD = """
models:
  - {name: base, engine: vllm, gpu_class: L4-24GB, max_loras: 4, max_lora_rank: 32}
  - {name: simbase, engine: sim, max_loras: 2, max_cpu_loras: 8}
  - {name: plain, engine: sim}
adapters:
  - {name: sql-lora, base: base, weights: /models/sql-lora, rank: 16}
  - {name: chat-lora, base: simbase, weights: chat-lora}
"""


def _problems(text: str) -> list[str]:
    with pytest.raises(CatalogError) as e:
        parse_catalog(text)
    return e.value.problems


def test_adapters_parse_with_their_base_and_round_trip() -> None:
    cat = parse_catalog(GOOD)
    assert cat.adapter_names == ("sql-lora", "chat-lora")
    sql = cat.adapter("sql-lora")
    assert sql is not None and (sql.base, sql.weights, sql.rank) == ("base", "/models/sql-lora", 16)
    assert [a.name for a in cat.adapters_of("simbase")] == ["chat-lora"]
    assert cat.adapters_of("plain") == ()
    base_of = cat.base_of("sql-lora")
    assert base_of is not None and base_of.name == "base"
    assert cat.adapter("base") is None and cat.get("sql-lora") is None
    assert parse_catalog(catalog_to_yaml(cat)) == cat
    # A catalog without adapters writes no adapters key (older readers refuse unknown keys).
    assert "adapters" not in catalog_to_yaml(Catalog(models=cat.models))


def test_slots_are_max_cpu_loras_where_set_else_max_loras() -> None:
    cat = parse_catalog(GOOD)
    slots = {m.name: m.adapter_slots for m in cat.models}
    assert slots == {"base": 4, "simbase": 8, "plain": 0}


@pytest.mark.parametrize(
    ("adapter", "wanted"),
    [
        ("{name: a, base: nope, weights: w}", "adapter 'a': base 'nope' is not a model of the catalog"),
        ("{name: a, base: plain, weights: w}", "adapter 'a': base 'plain' serves no adapters: set max_loras"),
        ("{name: a, base: base, weights: w, rank: 64}", "adapter 'a': rank 64 exceeds max_lora_rank 32"),
        ("{name: plain, base: base, weights: w}", "adapter 'plain': a model has the same name"),
        ("{name: 'bad name', base: base, weights: w}", "adapter 'bad name': model name"),
        ("{name: a, base: base}", "adapter 'a': weights: Field required"),
        ("{name: a, base: base, weights: w, rank: 0}", "adapter 'a': rank:"),
        ("{name: a, base: base, weights: w, colour: red}", "adapter 'a': colour: unknown field"),
    ],
)
def test_an_adapter_that_cannot_be_served_is_refused_saying_why(adapter: str, wanted: str) -> None:
    text = f"""
models:
  - {{name: base, engine: vllm, gpu_class: L4-24GB, max_loras: 4, max_lora_rank: 32}}
  - {{name: plain, engine: sim}}
adapters:
  - {adapter}
"""
    problems = _problems(text)
    assert any(p.startswith(wanted) for p in problems), problems


def test_duplicate_adapters_and_every_problem_are_listed_at_once() -> None:
    problems = _problems("""
models:
  - {name: base, engine: sim, max_loras: 2}
adapters:
  - {name: a, base: base, weights: w}
  - {name: a, base: base, weights: w}
  - {name: b, base: gone, weights: w}
""")
    assert len(problems) == 2, problems
    assert "adapter 'a': duplicate name (also adapters[0])" in problems
    assert problems[1].startswith("adapter 'b': base 'gone'")


@pytest.mark.parametrize(
    ("model", "wanted"),
    [
        ("{name: m, engine: llamacpp, max_loras: 2}", "model 'm': engine llamacpp cannot load adapters"),
        ("{name: m, engine: sim, max_cpu_loras: 2}", "model 'm': max_cpu_loras is set without max_loras"),
        ("{name: m, engine: sim, max_loras: 4, max_cpu_loras: 2}", "model 'm': max_cpu_loras 2 is below"),
        (
            "{name: m, engine: vllm, gpu_class: L4-24GB, max_loras: 2, max_lora_rank: 12}",
            "model 'm': vLLM takes max_lora_rank 12 from 1, 8, 16",
        ),
        ("{name: m, engine: sim, max_loras: 0}", "model 'm': max_loras:"),
    ],
)
def test_a_profile_whose_lora_flags_cannot_work_is_refused(model: str, wanted: str) -> None:
    problems = _problems(f"models:\n  - {model}\n")
    assert any(p.startswith(wanted) for p in problems), problems


def test_a_llamacpp_base_refuses_its_adapters_too() -> None:
    problems = _problems("""
models:
  - {name: m, engine: llamacpp, max_loras: 2}
adapters:
  - {name: a, base: m, weights: w}
""")
    assert "adapter 'a': base 'm' runs on llamacpp, which cannot load adapters at run time" in problems


def test_adapters_must_be_a_list() -> None:
    assert _problems("models: []\nadapters: {a: 1}\n") == ["'adapters' must be a list"]


def test_changing_an_adapter_does_not_change_its_bases_replica_spec() -> None:
    cat = parse_catalog(GOOD)
    base = cat.get("base")
    assert base is not None
    spec = ReplicaSpec.of(base)
    more = parse_catalog(GOOD + "  - {name: new-lora, base: base, weights: w2, rank: 8}\n")
    changed = parse_catalog(GOOD.replace("/models/sql-lora, rank: 16", "/models/sql-v2, rank: 32"))
    for cat2 in (more, changed):
        b2 = cat2.get("base")
        assert b2 is not None and spec.matches(b2) and ReplicaSpec.of(b2) == spec
    # The base's own LoRA flags are engine flags: changing them does roll its replicas.
    raised = parse_catalog(GOOD.replace("max_loras: 4,", "max_loras: 8,"))
    b3 = raised.get("base")
    assert b3 is not None and not spec.matches(b3)


def test_a_spec_stored_before_lora_still_matches_a_profile_without_it() -> None:
    cat = parse_catalog(GOOD)
    plain = cat.get("plain")
    assert plain is not None
    old = ReplicaSpec.of(plain).model_dump(exclude={"max_loras", "max_lora_rank", "max_cpu_loras"})
    assert ReplicaSpec.model_validate(old).matches(plain)


def test_an_assignments_adapters_never_change_its_engines_fingerprint() -> None:
    a = ShardAssignment(
        replica_id="r1", shard=0, model="base", engine="sim", port=9000, max_loras=4, max_lora_rank=16
    )
    with_one = a.model_copy(update={"adapters": (AdapterLoad(name="x", weights="w"),)})
    with_other = a.model_copy(update={"adapters": (AdapterLoad(name="y", weights="w2", rank=8),)})
    assert assignment_fingerprint(a) == assignment_fingerprint(with_one) == assignment_fingerprint(with_other)
    # ...while the LoRA flags are what the engine starts with.
    assert assignment_fingerprint(a) != assignment_fingerprint(a.model_copy(update={"max_loras": 2}))


def test_adapter_messages_cross_the_wire_and_default_for_older_senders() -> None:
    a = ShardAssignment(
        replica_id="r1",
        shard=0,
        model="base",
        engine="sim",
        port=1,
        adapters=(AdapterLoad(name="x", weights="/w", rank=8),),
    )
    assert decode(encode(a), ShardAssignment) == a
    load = ReplicaLoad(
        replica_id="r1", adapters=("x",), adapters_busy=("x",), adapter_errors={"y": "no weights at /w"}
    )
    assert decode(encode(load), ReplicaLoad) == load
    old = decode(encode(ReplicaLoad(replica_id="r1")), ReplicaLoad)
    assert (old.adapters, old.adapters_busy, old.adapter_errors) == ((), (), {})
