"""Plain data for the cache tests: an endpoint as the choice sees it, a tokenizer bundle as an agent makes it."""

from __future__ import annotations

import hashlib
import io
import zipfile
from dataclasses import dataclass

from llmgw_common.codec import encode
from llmgw_common.kvcache import TokenizerInfo, TokenizerKind
from llmgw_router.cache.tokenizers import INFO_ENTRY


@dataclass
class Ep:
    replica_id: str
    in_flight: int = 0
    running: float | None = None
    waiting: float | None = None
    kv_use: float | None = None
    load_at: float | None = None


def bundle(
    model: str,
    kind: TokenizerKind,
    files: dict[str, bytes] | None = None,
    *,
    lie: bool = False,
    info_model: str = "",
) -> bytes:
    files = files or {}
    sums = {n: hashlib.sha256(b"other" if lie else b).hexdigest() for n, b in files.items()}
    info = TokenizerInfo(model=info_model or model, kind=kind, files=sums, published_at=1.0)
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as z:
        z.writestr(INFO_ENTRY, encode(info))
        for n, b in files.items():
            z.writestr(n, b)
    return buf.getvalue()
