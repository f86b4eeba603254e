"""Names people choose (nodes, models) and text that came from outside, on their way to a person.

Two halves, one module, so that every entry and every sink agree on what a control character is:

- Entries refuse: :func:`check_token` (node names, fabrics, prefixes: one NATS subject token) and
  :func:`check_model_name` (catalog model names). Both match the whole string: ``$`` in a Python
  regex also matches before a final newline, which let ``"tiny2\\n"`` through as a model name.
  :data:`NodeName` is the same check as a pydantic type, for messages that name their sender.
- Sinks escape: :func:`visible` writes control and format characters (terminal escapes, OSC 8
  hyperlinks, bidi overrides, zero-width characters) as ``\\x1b``/``\\u202e`` so that a terminal or a
  log viewer shows them instead of obeying them. Slack's own markup is escaped where Slack text is
  made (``llmgw_notifier.formats``); the console's templates autoescape HTML.
"""

from __future__ import annotations

import logging
import re
import unicodedata
from typing import Annotated

from pydantic import AfterValidator

from llmgw_common.errors import InvalidInput

_TOKEN = re.compile(r"[A-Za-z0-9_-]+")
_MODEL = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:/-]*")
# Longer than any real model id (Hugging Face's are at most 96 + 1 + 96); names travel in subjects,
# metric labels, wake requests and replies, and a wake's answer echoes the name it was asked for.
MAX_MODEL_NAME = 256
# Cc: C0/C1 controls (ESC, BEL, CR, ...). Cf: format characters (bidi overrides, zero-width joiners).
# Zl/Zp: the Unicode line and paragraph separators, which some terminals and viewers break lines on.
_INVISIBLE = frozenset({"Cc", "Cf", "Zl", "Zp"})
_SHORT = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}


def check_token(value: str, what: str = "name") -> str:
    """A single NATS subject token: no dots, spaces, wildcards or control characters. InvalidInput
    (a ValueError) otherwise."""
    if not _TOKEN.fullmatch(value):
        shown = value if len(value) <= 80 else f"{value[:80]}... ({len(value)} characters)"
        raise InvalidInput(f"{what} {visible(repr(shown))} may contain only letters, digits, '-' and '_'")
    return value


def check_model_name(value: str) -> str:
    """A catalog model name: letters, digits and ``. _ : / -``, starting with a letter or digit, at most
    :data:`MAX_MODEL_NAME` characters."""
    if len(value) > MAX_MODEL_NAME:
        raise ValueError(
            f"model name {visible(repr(value[:80]))}... ({len(value)} characters) is longer than "
            f"{MAX_MODEL_NAME} characters"
        )
    if not _MODEL.fullmatch(value):
        raise InvalidInput(
            f"model name {visible(repr(value))} may contain only letters, digits and . _ : / - "
            "(starting with a letter or digit)"
        )
    return value


def _node_name(value: str) -> str:
    return check_token(value, "node name")


# The node a message says it comes from: a message whose node is not a token is refused at decode,
# so it is dropped with one log line before any table, log or webhook could show it.
NodeName = Annotated[str, AfterValidator(_node_name)]


def _router_id(value: str) -> str:
    return check_token(value, "router id")


# The router a report says it comes from: a token, like the subject that carries it.
RouterId = Annotated[str, AfterValidator(_router_id)]


def clipped(text: str, limit: int) -> str:
    """``text`` cut to at most ``limit`` characters, saying how long it was (an error a sender chose
    the length of, on its way into tables, replies and stored values that have a size limit)."""
    if len(text) <= limit:
        return text
    tail = f"... ({len(text)} characters)"
    return text[: max(0, limit - len(tail))] + tail


def as_token(text: str) -> str:
    """``text`` with every character a subject token may not hold written as ``-`` (e.g. a hostname's
    dots: ``gpu1.example.com`` -> ``gpu1-example-com``)."""
    return re.sub(r"[^A-Za-z0-9_-]", "-", text) or "-"


def is_invisible(ch: str) -> bool:
    return unicodedata.category(ch) in _INVISIBLE


def visible(text: str, keep: str = "") -> str:
    """``text`` with every control or format character written as a Python escape (``\\x1b``);
    the characters in ``keep`` (e.g. ``"\\n"`` for multi-line output) are left as they are."""
    if all(ch.isprintable() or ch in keep for ch in text):
        return text  # the common case: nothing to do (isprintable is False for every invisible kind)
    out = []
    for ch in text:
        if ch in keep or not is_invisible(ch):
            out.append(ch)
        elif ch in _SHORT:
            out.append(_SHORT[ch])
        elif ord(ch) <= 0xFF:
            out.append(f"\\x{ord(ch):02x}")
        else:
            out.append(f"\\u{ord(ch):04x}" if ord(ch) <= 0xFFFF else f"\\U{ord(ch):08x}")
    return "".join(out)


class VisibleFormatter(logging.Formatter):
    """Log lines with control characters escaped (newlines and tabs kept): a name or an engine's
    output that carries terminal escapes must not drive the terminal or viewer that reads the log."""

    def formatMessage(self, record: logging.LogRecord) -> str:
        record.message = visible(record.message, keep="\n\t")
        return super().formatMessage(record)
