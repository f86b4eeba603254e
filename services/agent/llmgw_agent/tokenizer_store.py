"""A model's tokenizer, put where routers read it: one object per model in ``Subjects.bucket_tokenizers``.

A router computes a request's prefix blocks as the engine will, so it needs the served model's own
tokenizer and chat template. The agent beside the weights has them: when a replica is ready it puts
ONE object, named for the model, whose content is a zip of the model directory's tokenizer files
(:data:`TOKENIZER_FILES`, those present) and an entry :data:`INFO_ENTRY`, the
:class:`~llmgw_common.kvcache.TokenizerInfo` (``codec.encode``) naming each file's sha256. A simulated
engine gets the same object with ``kind`` SIM and no files (its tokenizer is ``llmgw_common.simtokens``).

Many agents serve one model: the object's ``description`` holds :attr:`Bundle.digest` (of the kind
and the files' digests, not of the zip, whose record carries a time), and an agent puts the object
only when the stored one's differs.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import zipfile
from dataclasses import dataclass
from pathlib import Path

from nats.js.api import ObjectMeta
from nats.js.errors import ObjectNotFoundError
from nats.js.object_store import ObjectStore

from llmgw_common.codec import encode
from llmgw_common.kvcache import TokenizerInfo, TokenizerKind

log = logging.getLogger("llmgw.agent.tokenizers")

# What a router needs of a Hugging Face model directory to tokenize a chat as vLLM does.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
    "chat_template.json",
    "special_tokens_map.json",
    "generation_config.json",
)
INFO_ENTRY = "llmgw-tokenizer.msgpack"
# A tokenizer file larger than this is not put on the bus (tokenizer.json of large vocabularies is
# 10-20 MB; the object store chunks it).
MAX_FILE_BYTES = 64 * 1024 * 1024
# Fixed zip entry times: the same files make the same bytes on every node.
_ZIP_TIME = (1980, 1, 1, 0, 0, 0)


@dataclass(frozen=True, slots=True)
class Bundle:
    model: str
    info: TokenizerInfo
    data: bytes

    @property
    def digest(self) -> str:
        return bundle_digest(self.info)


def bundle_digest(info: TokenizerInfo) -> str:
    """What identifies a tokenizer's content: its kind and its files' digests."""
    blob = json.dumps([info.kind.value, sorted(info.files.items())]).encode()
    return hashlib.sha256(blob).hexdigest()


def _zip(entries: dict[str, bytes]) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", compression=zipfile.ZIP_DEFLATED) as z:
        for name in sorted(entries):
            z.writestr(zipfile.ZipInfo(name, date_time=_ZIP_TIME), entries[name])
    return buf.getvalue()


def hf_bundle(model: str, model_dir: Path, now: float) -> Bundle | None:
    """The bundle of a Hugging Face model directory; None without a ``tokenizer.json`` (nothing a
    router could use), or when a file cannot be read."""
    if not (model_dir / "tokenizer.json").is_file():
        return None
    files: dict[str, bytes] = {}
    for name in TOKENIZER_FILES:
        path = model_dir / name
        try:
            if path.is_file() and path.stat().st_size <= MAX_FILE_BYTES:
                files[name] = path.read_bytes()
        except OSError as e:
            log.warning("cannot read %s for the tokenizer of %s: %s", path, model, e)
            return None
    info = TokenizerInfo(
        model=model,
        kind=TokenizerKind.HF,
        files={n: hashlib.sha256(b).hexdigest() for n, b in files.items()},
        published_at=now,
    )
    return Bundle(model, info, _zip({**files, INFO_ENTRY: encode(info)}))


def sim_bundle(model: str, now: float) -> Bundle:
    info = TokenizerInfo(model=model, kind=TokenizerKind.SIM, published_at=now)
    return Bundle(model, info, _zip({INFO_ENTRY: encode(info)}))


async def publish(store: ObjectStore, bundle: Bundle) -> bool:
    """Put ``bundle`` under its model's name unless the stored one has the same digest; True if put."""
    try:
        stored = await store.get_info(bundle.model)
    except ObjectNotFoundError:
        stored = None
    if stored is not None and stored.description == bundle.digest:
        return False
    await store.put(bundle.model, bundle.data, meta=ObjectMeta(name=bundle.model, description=bundle.digest))
    return True
