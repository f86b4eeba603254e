"""The kinds of failure llmgw reports, so that a caller can act on the kind instead of the class.

::

    LlmgwError                      str(e) is what a user is shown (it may hold several lines)
     ├── InvalidInput (ValueError)  the operator's or client's input is wrong: fix it, then retry
     │     ProblemsError: CatalogError, FleetError, StaticConfigError; YamlError, KeyOpError, StartupError,
     │     AdminBindError, BadRequest (sim), check_token / check_model_name refusals
     ├── Unavailable                something needed is not reachable or not up now: retry later
     │     CtlUnavailable, NatsServerError, SourceUnavailable, UpstreamError (router -> engine)
     ├── Conflict                   the state changed under us; nothing was changed: read again
     │     DesiredConflict
     ├── Refused                    refused by policy or capacity
     │     AdmissionRefused, PortsExhausted
     ├── BadMessage (ValueError)    bus data that does not decode
     │     DecodeError, ChunkError
     └── (no kind)                  CtlError (the control plane's answer; its code says more), UpError

Each class keeps the builtin base it had (``ValueError``, ``RuntimeError``, ``yaml.YAMLError``), so
every ``except`` written before this module still catches what it caught.

Left outside on purpose, because they are control flow, not failures to report: a generic
``except LlmgwError`` must never swallow them.

- ``Fenced``, ``LeaseLost``, ``NotOurs`` (control plane): "this process is no longer the leader";
  the control plane steps down on them, a user never sees them.
- ``TaskDied``, ``FailedPasses`` (runtime): a loop that must run for the process's life ended;
  :func:`llmgw_runtime.runtime.run_service` turns them into exit status 70 so the process is replaced.
- ``FaultExit`` (sim): the simulator's ``exit_after`` fault, an exit with a chosen status.
- ``_Retryable``, ``_Expired`` (router), ``_Truncated`` (agent): private signals inside one module.

The CLI's ``main()`` turns an :class:`LlmgwError` that escapes a command into ``error: <message>``
and an exit status by kind (:func:`exit_status`).
"""

from __future__ import annotations

# Wrong input exits 2, as click's usage errors and every llmgw command's "bad settings" already do;
# unavailable is sysexits.h's EX_UNAVAILABLE, so a wrapper script can tell "retry later" apart.
EXIT_INVALID_INPUT = 2
EXIT_UNAVAILABLE = 69
EXIT_OTHER = 1


class LlmgwError(Exception):
    """Base of llmgw's reportable errors; ``str(e)`` is the message a user sees."""


class InvalidInput(LlmgwError, ValueError):
    """The operator's or client's input is wrong (catalog, fleet file, static file, settings, request)."""


class Unavailable(LlmgwError):
    """Something needed is not reachable or not up now (the bus, a control plane, a process, a port)."""


class Conflict(LlmgwError):
    """The state changed between our read and our write; nothing was changed."""


class Refused(LlmgwError):
    """Refused by policy or capacity."""


class BadMessage(LlmgwError, ValueError):
    """Bus data that does not decode into the message it should be."""


def exit_status(e: LlmgwError) -> int:
    """The process exit status for ``e`` escaping a command: 2 bad input, 69 unavailable, else 1."""
    if isinstance(e, InvalidInput):
        return EXIT_INVALID_INPUT
    if isinstance(e, Unavailable):
        return EXIT_UNAVAILABLE
    return EXIT_OTHER
