"""The form fields the router reads from a ``multipart/form-data`` body (audio: ``model``, ``stream``).

Only the small text fields are read; the parts are found by searching for the boundary, so an audio
file of megabytes is neither copied nor decoded. What is wrong is said in the client's terms (a 400).
"""

from __future__ import annotations

import re

_BOUNDARY = re.compile(r'boundary=(?:"([^"]{1,70})"|([^\s;"]{1,70}))', re.IGNORECASE)
_NAME = re.compile(rb'\bname="([^"]*)"', re.IGNORECASE)
# Fields read, and the most of each kept (a model name is short; anything longer is not one).
_WANTED = frozenset({b"model", b"stream"})
_MAX_VALUE = 1024


def form_fields(body: bytes, content_type: str | None) -> dict[str, str] | str:
    """``model`` (and ``stream`` when present) of a form, or what is wrong with it (a 400 message)."""
    if content_type is None or not content_type.lower().startswith("multipart/form-data"):
        return "this endpoint takes a multipart/form-data body (a file and a model field)"
    m = _BOUNDARY.search(content_type)
    if m is None:
        return "the multipart/form-data Content-Type has no boundary"
    delim = b"--" + (m.group(1) or m.group(2)).encode("latin-1")
    fields: dict[str, str] = {}
    at = body.find(delim)
    while at >= 0:
        start = at + len(delim)
        if body[start : start + 2] == b"--":
            break  # the closing delimiter
        head_end = body.find(b"\r\n\r\n", start)
        nxt = body.find(b"\r\n" + delim, start)
        if head_end < 0 or (0 <= nxt < head_end):
            return "a part of the multipart/form-data body has no headers"
        name = _NAME.search(body, start, head_end)
        if name is not None and name.group(1) in _WANTED:
            end = nxt if nxt >= 0 else len(body)
            value = body[head_end + 4 : min(end, head_end + 4 + _MAX_VALUE)]
            fields[name.group(1).decode()] = value.decode("utf-8", "replace").strip()
        at = nxt + 2 if nxt >= 0 else -1
    model = fields.get("model")
    if not model:
        return "you must provide a model parameter (a form field named model)"
    return fields
