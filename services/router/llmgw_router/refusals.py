"""The refusals more than one route gives, worded once."""

from __future__ import annotations

from llmgw_router.errors import RouterError, error_response


def not_found_message(model: str) -> str:
    # One message for "not in the catalog" and "not allowed for your key", so a key cannot probe the
    # catalog (ARCHITECTURE #12 in spirit): both are 404 model_not_found, as OpenAI answers.
    return f"The model '{model}' does not exist or your API key may not use it"


def gone(response_id: str) -> RouterError:
    return error_response(
        404,
        f"response {response_id!r} is gone: the replica that stored it no longer serves (a stored "
        "response lives in the memory of the one replica that made it)",
        code="response_not_found",
    )
