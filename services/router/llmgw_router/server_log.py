"""aiohttp.web's server logger for the OpenAI listener: a malformed request is one line, not a traceback.

aiohttp answers bytes that are not HTTP (a raw non-UTF-8 byte in the path, a control character in the
request line) with a 400 itself, before any handler runs, and logs each at ERROR with a traceback of
its parser: anyone can flood the log with them. Those are the client's fault, so they get one DEBUG
line (as aiohttp already does for a bad method); anything else keeps its traceback.
"""

from __future__ import annotations

import logging
import sys
from typing import Any, cast

from aiohttp.http_exceptions import HttpProcessingError

_LOG = logging.getLogger("aiohttp.server")


class _Quiet(logging.LoggerAdapter):  # type: ignore[type-arg]
    def exception(self, msg: object, *args: object, exc_info: Any = True, **kw: Any) -> None:
        exc = exc_info if isinstance(exc_info, BaseException) else sys.exc_info()[1]
        if isinstance(exc, HttpProcessingError) and 400 <= exc.code < 500:
            text = str(exc.message).splitlines()[0] if exc.message else type(exc).__name__
            self.logger.debug(f"{msg}: %s (%d)", *args, text, exc.code)
            return
        self.logger.exception(msg, *args, exc_info=exc_info, **kw)


def server_logger() -> logging.Logger:
    """The logger to pass as ``logger=`` to ``web.AppRunner`` (aiohttp calls debug/exception on it)."""
    return cast(logging.Logger, _Quiet(_LOG, {}))
