"""The one codec for everything on the bus: msgpack of a message's fields plus a schema version.

``decode`` either returns a valid message or raises :class:`DecodeError`; nothing else escapes,
whatever the bytes.
"""

from __future__ import annotations

from typing import Any, TypeVar

import msgpack
from pydantic import BaseModel, ValidationError

from llmgw_common.errors import BadMessage

SCHEMA_VERSION = 1
VERSION_KEY = "_v"
# A payload larger than this is refused before unpacking (NATS' own default max_payload is 1 MiB).
MAX_PAYLOAD = 8 * 1024 * 1024

M = TypeVar("M", bound=BaseModel)


class DecodeError(BadMessage):
    """A payload that is not a valid message of the expected type and schema version."""


def encode(msg: BaseModel) -> bytes:
    data = msg.model_dump(mode="json")
    data[VERSION_KEY] = SCHEMA_VERSION
    out: bytes = msgpack.packb(data, use_bin_type=True)
    return out


def decode(data: bytes, cls: type[M], *, limit: int = MAX_PAYLOAD) -> M:
    """``limit``: the largest payload accepted; a caller that assembled a reply from parts it asked
    for (a chunked ctl answer) may allow more than one message's worth."""
    if len(data) > limit:
        raise DecodeError(f"{cls.__name__}: payload of {len(data)} bytes exceeds {limit}")
    try:
        raw: Any = msgpack.unpackb(data, raw=False, strict_map_key=True)
    except Exception as e:  # msgpack raises a zoo of types (ExtraData, FormatError, ValueError, ...)
        raise DecodeError(f"{cls.__name__}: not msgpack ({type(e).__name__})") from None
    if not isinstance(raw, dict):
        raise DecodeError(f"{cls.__name__}: expected a map, got {type(raw).__name__}")
    version = raw.pop(VERSION_KEY, None)
    if version != SCHEMA_VERSION:
        raise DecodeError(f"{cls.__name__}: schema version {version!r}, this build reads {SCHEMA_VERSION}")
    try:
        return cls.model_validate(raw)
    except ValidationError as e:
        first = e.errors()[0]
        loc = ".".join(str(x) for x in first["loc"])
        raise DecodeError(f"{cls.__name__}: {loc}: {first['msg']} ({e.error_count()} problem(s))") from None
    except (TypeError, ValueError, RecursionError) as e:
        raise DecodeError(f"{cls.__name__}: {e}") from None
