"""The fleet file of ``llmgw up``: the simulated GPU nodes to start, one agent process each.

Format (YAML)::

    nodes:
      - name: gpu-a1              # node id: letters, digits, '-' and '_' (a NATS subject token)
        fabric: ib-a              # optional: nodes of one multi-node replica share a fabric
        gpus: 8xH100-80GB         # optional: '<count>x<CLASS>', the class ending in its memory
        unhealthy: {3: XID 79}    # optional: GPU index -> reason; such GPUs are neither used nor free
        memory_gb: 2048           # optional: simulated MemTotal; absent means "not reported"
        labels: {role: coding}    # optional: for node_selector

:func:`parse_fleet` validates the file as a whole and raises :class:`FleetError` listing every
problem, so an operator fixes it in one round.
"""

from __future__ import annotations

import json
import re
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator

from llmgw_common.gpuspec import parse_sim_gpus
from llmgw_common.subjects import check_token
from llmgw_common.validation import ProblemsError, document_mapping, read_document, validate_named

_GPU_SPEC = re.compile(r"^\s*(\d+)\s*[xX]\s*([A-Za-z0-9][A-Za-z0-9._-]*)\s*$")


class FleetError(ProblemsError):
    """A fleet file that cannot be used; ``problems`` lists every reason."""

    document = "fleet file"


def parse_gpu_spec(spec: str) -> tuple[int, str]:
    """``'8xH100-80GB'`` -> ``(8, 'H100-80GB')``; ValueError naming the expected shape otherwise."""
    m = _GPU_SPEC.match(spec)
    if not m:
        raise ValueError(f"GPU spec {spec!r} is not '<count>x<CLASS>', e.g. '8xH100-80GB'")
    try:
        # The agent's own reading of the spec (the class names its memory): refuse here what it would.
        parse_sim_gpus(spec)
    except ValueError as e:
        raise ValueError(str(e).replace("sim_gpus", "GPU spec")) from None
    return int(m.group(1)), m.group(2)


class FleetNode(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str
    fabric: str | None = None
    gpus: str | None = None
    unhealthy: dict[int, str] = Field(default_factory=dict)
    memory_gb: float | None = Field(default=None, gt=0)
    labels: dict[str, str] = Field(default_factory=dict)

    @field_validator("gpus", mode="before")
    @classmethod
    def _gpus(cls, v: Any) -> Any:
        if v is None:
            return v
        if not isinstance(v, str):
            raise ValueError(f"GPU spec {v!r} is not '<count>x<CLASS>', e.g. '8xH100-80GB'")
        parse_gpu_spec(v)
        return v.strip()

    @property
    def gpu_count(self) -> int:
        return parse_gpu_spec(self.gpus)[0] if self.gpus else 0

    @property
    def gpu_class(self) -> str | None:
        return parse_gpu_spec(self.gpus)[1] if self.gpus else None

    def agent_env(self) -> dict[str, str]:
        """The ``LLMGW_*`` settings of this node's agent (AgentSettings), as environment variables."""
        env = {"LLMGW_NODE": self.name, "LLMGW_SIMULATE_ENGINES": "true"}
        if self.fabric:
            env["LLMGW_FABRIC"] = self.fabric
        if self.gpus and self.gpu_count > 0:
            env["LLMGW_SIM_GPUS"] = f"{self.gpu_count}x{self.gpu_class}"
        if self.unhealthy:
            env["LLMGW_SIM_UNHEALTHY"] = json.dumps({str(k): v for k, v in self.unhealthy.items()})
        if self.memory_gb is not None:
            env["LLMGW_SIM_MEMORY_GB"] = repr(float(self.memory_gb))
        if self.labels:
            env["LLMGW_LABELS"] = json.dumps(self.labels)
        return env


class Fleet(BaseModel):
    model_config = ConfigDict(frozen=True)

    nodes: tuple[FleetNode, ...] = ()


def _semantic_problems(n: FleetNode) -> list[str]:
    where = f"node {n.name!r}"
    out: list[str] = []
    try:
        check_token(n.name, "node name")
    except ValueError as e:
        out.append(f"{where}: {e}")
    if n.fabric is not None:
        try:
            check_token(n.fabric, "fabric")
        except ValueError as e:
            out.append(f"{where}: {e}")
    count = n.gpu_count
    for idx in sorted(n.unhealthy):
        if not 0 <= idx < count:
            have = f"GPUs 0-{count - 1}" if count else "no GPUs"
            out.append(f"{where}: unhealthy GPU {idx} does not exist (the node has {have})")
    return out


def _checks(n: FleetNode) -> list[str]:
    out = _semantic_problems(n)
    if n.name == "local":
        out.append(f"node {n.name!r}: the name 'local' is taken by the real machine's agent")
    return out


def parse_fleet(data: Any) -> Fleet:
    """A validated fleet from a mapping or YAML text; FleetError lists every problem."""
    data = document_mapping(data, FleetError, "a fleet file is a mapping with a 'nodes' list")
    problems = [f"unknown top-level field {k!r} (known: nodes)" for k in data if k != "nodes"]
    raw_nodes = data.get("nodes") or []
    if not isinstance(raw_nodes, list):
        raise FleetError([*problems, "'nodes' must be a list"])
    nodes, found = validate_named(raw_nodes, FleetNode, kind="node", list_name="nodes", checks=_checks)
    problems.extend(found)
    if problems:
        raise FleetError(problems)
    return Fleet(nodes=tuple(nodes))


def load_fleet_file(path: str) -> Fleet:
    return parse_fleet(read_document(path, FleetError))
