"""Every exception class of llmgw has a kind (llmgw_common.errors), or is control flow on purpose.

A new exception class must pick a kind, so that the CLI reports it as one line with the right exit
status; and every class keeps the builtin base its callers catch it by.
"""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest
import yaml

from llmgw_common import errors

ROOT = Path(__file__).resolve().parents[2]
KINDS = (errors.InvalidInput, errors.Unavailable, errors.Conflict, errors.Refused, errors.BadMessage)
# Control flow, not failures to report (the module docstring of llmgw_common.errors says why).
OUTSIDE = {
    "llmgw_controlplane.apply.Fenced",
    "llmgw_controlplane.announcements.FencedAbove",
    "llmgw_controlplane.leader.LeaseLost",
    "llmgw_controlplane.leader.NotOurs",
    "llmgw_runtime.runtime.TaskDied",
    "llmgw_runtime.runtime.FailedPasses",
    "llmgw_sim.engine.FaultExit",
    "llmgw_router.failover.migration._Incomplete",
    "llmgw_router.failover.relay.Unframed",
    "llmgw_router.tenancy.admission._Expired",
    "llmgw_router.tenancy.admission._PushedOut",
    "llmgw_router.http.connection._Stop",
    "llmgw_agent.weight_files._Truncated",
    "llmgw_agent.kvtranslate._Unfit",
    "llmgw_router.cache.hf_messages.Unpredictable",
}
# Without a kind: their cases differ (a control plane's refusal, any reason `up` cannot go on).
NO_KIND = {"llmgw_runtime.ctl_client.CtlError", "llmgw_cli.cmd_up.UpError"}


def exception_classes() -> list[type[BaseException]]:
    """Every class defined at the top of an llmgw module that is an exception."""
    found: list[type[BaseException]] = []
    for pkg_dir in sorted([*ROOT.glob("libs/*/llmgw_*"), *ROOT.glob("services/*/llmgw_*")]):
        for path in sorted(pkg_dir.rglob("*.py")):
            names = [n.name for n in ast.parse(path.read_text()).body if isinstance(n, ast.ClassDef)]
            if not names:
                continue
            module = ".".join(path.relative_to(pkg_dir.parent).with_suffix("").parts)
            mod = importlib.import_module(module)
            for name in names:
                cls = getattr(mod, name)
                if isinstance(cls, type) and issubclass(cls, BaseException):
                    found.append(cls)
    return found


def qualname(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def test_every_exception_class_has_a_kind_or_is_control_flow_on_purpose() -> None:
    classes = exception_classes()
    assert len(classes) > 20  # the walk found the modules
    stray = [
        qualname(c)
        for c in classes
        if c.__module__ != errors.__name__
        and qualname(c) not in OUTSIDE
        and qualname(c) not in NO_KIND
        and not issubclass(c, KINDS)
        and not any(issubclass(c, o) for o in classes if o is not c and qualname(o) in NO_KIND)
    ]
    assert stray == []
    assert [qualname(c) for c in classes if qualname(c) in OUTSIDE and issubclass(c, errors.LlmgwError)] == []


@pytest.mark.parametrize(
    ("path", "kind", "builtin"),
    [
        ("llmgw_common.catalog.CatalogError", errors.InvalidInput, ValueError),
        ("llmgw_cli.fleet.FleetError", errors.InvalidInput, ValueError),
        ("llmgw_router.static.StaticConfigError", errors.InvalidInput, ValueError),
        ("llmgw_common.yamlsafe.YamlError", errors.InvalidInput, yaml.YAMLError),
        ("llmgw_runtime.apikeys.KeyOpError", errors.InvalidInput, Exception),
        ("llmgw_controlplane.service.StartupError", errors.InvalidInput, RuntimeError),
        ("llmgw_controlplane.admin.AdminBindError", errors.InvalidInput, RuntimeError),
        ("llmgw_sim.openai_api.BadRequest", errors.InvalidInput, ValueError),
        ("llmgw_runtime.ctl_client.CtlUnavailable", errors.Unavailable, Exception),
        ("llmgw_runtime.natsserver.NatsServerError", errors.Unavailable, RuntimeError),
        ("llmgw_controlplane.admin.SourceUnavailable", errors.Unavailable, Exception),
        ("llmgw_router.upstream.connection.ConnectFailed", errors.Unavailable, Exception),
        ("llmgw_controlplane.desired.DesiredConflict", errors.Conflict, Exception),
        ("llmgw_router.tenancy.admission.AdmissionRefused", errors.Refused, Exception),
        ("llmgw_controlplane.scheduler.ports.PortsExhausted", errors.Refused, RuntimeError),
        ("llmgw_common.codec.DecodeError", errors.BadMessage, ValueError),
        ("llmgw_common.chunks.ChunkError", errors.BadMessage, ValueError),
    ],
    ids=lambda v: v.rsplit(".", 1)[-1] if isinstance(v, str) else v.__name__,
)
def test_kind_and_the_builtin_base_callers_catch_it_by(path: str, kind: type, builtin: type) -> None:
    module, name = path.rsplit(".", 1)
    cls = getattr(importlib.import_module(module), name)
    assert issubclass(cls, kind) and issubclass(cls, builtin)


@pytest.mark.parametrize(
    ("exc", "status"),
    [
        (errors.InvalidInput("x"), 2),
        (errors.BadMessage("x"), 1),
        (errors.Unavailable("x"), 69),
        (errors.Refused("x"), 1),
    ],
    ids=["invalid-input", "bad-message", "unavailable", "refused"],
)
def test_exit_status_by_kind(exc: errors.LlmgwError, status: int) -> None:
    assert errors.exit_status(exc) == status


def test_a_name_that_is_not_a_token_is_invalid_input() -> None:
    from llmgw_common.names import check_model_name, check_token

    with pytest.raises(errors.InvalidInput, match=r"node 'a\.b' may contain only"):
        check_token("a.b", "node")
    with pytest.raises(errors.InvalidInput, match="model name"):
        check_model_name("-x")
