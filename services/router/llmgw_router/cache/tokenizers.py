"""Where a model's tokenizer comes from: the object store ``<prefix>_tokenizers``, one object per model.

The agent holding a model's weights puts there, under the model's name, a zip of the tokenizer's files
(``tokenizer.json``, its config, the chat template: flat names) and an entry :data:`INFO_ENTRY`, the
codec-encoded :class:`~llmgw_common.kvcache.TokenizerInfo` (kind, and each file's sha256). A router loads
it in the background, when a model appears in its catalog and when the object changes (a poll of each
object's digest every ``poll_s``, and at once on :meth:`TokenizerStore.kick`), never on the request path:
there, :meth:`TokenizerStore.get` is a dict lookup, None until the model's tokenizer is loaded (its
requests then go by load alone).

- ``sim``: the simulator's tokenizer (``llmgw_common.simtokens``), no files.
- ``hf``: :class:`~llmgw_router.cache.hf_tokenizer.HfPromptTokenizer` over the files (vLLM's chat path).

Memory: one tokenizer per catalog model (a tokenizer.json can be 30 MB, its parsed form more), the old
one released when the object changes, a model's dropped when it leaves the catalog; an object over
``max_bytes`` is refused before it is read. A bundle that does not load (not a zip, no info entry, a
file whose sha256 is not the info's, a builder that raises ValueError) is logged once per version of
the object and counted; the model keeps routing by load, and a new version is tried again.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import io
import json
import logging
import zipfile
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import nats.errors
from nats.js.client import JetStreamContext
from nats.js.errors import NotFoundError
from nats.js.object_store import ObjectStore

from llmgw_common import simtokens
from llmgw_common.codec import DecodeError, decode
from llmgw_common.errors import BadMessage
from llmgw_common.kvcache import TokenizerInfo, TokenizerKind
from llmgw_common.names import visible
from llmgw_common.subjects import Subjects
from llmgw_runtime.runtime import cancel_and_wait

log = logging.getLogger("llmgw.router.cache.tokenizers")

# The zip entry holding the codec-encoded TokenizerInfo.
INFO_ENTRY = "llmgw-tokenizer.msgpack"
# An object larger than this is not read (a tokenizer.json is up to ~30 MB; zipped, less).
DEFAULT_MAX_BYTES = 64 << 20
# Entries of a bundle at most, and their size unzipped in all (a zip bomb is refused, not inflated).
MAX_ENTRIES = 64
MAX_UNZIPPED = 256 << 20
DEFAULT_POLL_S = 5.0


class PromptTokenizer(Protocol):
    def prompt_ids(self, body: Mapping[str, Any]) -> list[int] | None: ...


class BundleError(BadMessage):
    """A tokenizer object that cannot be used, with the reason."""


class SimPromptTokenizer:
    """The simulator's tokenizer, behind the same call as an HF one."""

    def prompt_ids(self, body: Mapping[str, Any]) -> list[int] | None:
        return simtokens.prompt_token_ids(dict(body))


Builder = Callable[[TokenizerInfo, dict[str, bytes]], PromptTokenizer]


def build_tokenizer(info: TokenizerInfo, files: dict[str, bytes]) -> PromptTokenizer:
    """The tokenizer a bundle describes. Raises ValueError when it cannot be built."""
    if info.kind is TokenizerKind.SIM:
        return SimPromptTokenizer()
    # Imported here: jinja2 and the template machinery load only where a model has an HF tokenizer.
    from llmgw_router.cache.hf_tokenizer import HfPromptTokenizer

    try:
        return HfPromptTokenizer(files)
    except Exception as e:
        # Foreign code over the agent's files: tokenizers' Rust errors are bare Exceptions, jinja2 has its
        # own tree. Whatever it is, this version of the bundle is unusable, which is a ValueError here.
        raise BundleError(f"the HF tokenizer does not build ({type(e).__name__}: {e})") from None


def read_bundle(data: bytes) -> tuple[TokenizerInfo, dict[str, bytes]]:
    """A bundle's info and files, checked: every file the info names is there with its sha256."""
    try:
        z = zipfile.ZipFile(io.BytesIO(data))
    except zipfile.BadZipFile as e:
        raise BundleError(f"not a zip ({e})") from None
    with z:
        entries = z.infolist()
        if len(entries) > MAX_ENTRIES:
            raise BundleError(f"{len(entries)} entries, more than {MAX_ENTRIES}")
        if sum(e.file_size for e in entries) > MAX_UNZIPPED:
            raise BundleError(f"more than {MAX_UNZIPPED} bytes unzipped")
        names = {e.filename for e in entries}
        if INFO_ENTRY not in names:
            raise BundleError(f"no {INFO_ENTRY} entry")
        try:
            info = decode(z.read(INFO_ENTRY), TokenizerInfo)
            files = {n: z.read(n) for n in info.files}
        except DecodeError as e:
            raise BundleError(str(e)) from None
        except KeyError as e:
            raise BundleError(f"the info names {e} and the zip has no such entry") from None
        except (zipfile.BadZipFile, OSError, EOFError, NotImplementedError) as e:
            # A damaged entry (CRC, truncation) or an unsupported compression.
            raise BundleError(f"an entry does not read ({type(e).__name__}: {e})") from None
    for name, want in info.files.items():
        got = hashlib.sha256(files[name]).hexdigest()
        if got != want.lower():
            raise BundleError(f"{name}: sha256 {got[:12]}…, the info says {want[:12]}…")
    return info, files


@dataclass(slots=True)
class _Loaded:
    digest: str
    tokenizer: PromptTokenizer | None  # None: this version failed to load
    kind: TokenizerKind | None
    # What the tokenizer was built from (its kind and files' digests): equal means the same tokenizer.
    files: str = ""


def _files_key(info: TokenizerInfo) -> str:
    return json.dumps([info.kind.value, sorted(info.files.items())])


class TokenizerStore:
    """Per catalog model, its tokenizer, loaded in the background. ``models()`` names the catalog's models."""

    def __init__(
        self,
        js: JetStreamContext,
        subjects: Subjects,
        models: Callable[[], Iterable[str]],
        *,
        build: Builder = build_tokenizer,
        poll_s: float = DEFAULT_POLL_S,
        max_bytes: int = DEFAULT_MAX_BYTES,
    ) -> None:
        self.js = js
        self.subjects = subjects
        self.models = models
        self.build = build
        self.poll_s = poll_s
        self.max_bytes = max_bytes
        self._loaded: dict[str, _Loaded] = {}
        self._store: ObjectStore | None = None
        self._kick = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        # Numbers for operators: versions that failed to load, loads done, passes that found no bucket.
        self.failures = 0
        self.loads = 0
        self.passes = 0

    def get(self, model: str) -> PromptTokenizer | None:
        """The model's tokenizer, or None while none is loaded. The request path's only call."""
        got = self._loaded.get(model)
        return got.tokenizer if got is not None else None

    def kind(self, model: str) -> TokenizerKind | None:
        got = self._loaded.get(model)
        return got.kind if got is not None and got.tokenizer is not None else None

    def loaded(self) -> list[str]:
        return sorted(m for m, got in self._loaded.items() if got.tokenizer is not None)

    def kick(self) -> None:
        """Look again now (the catalog changed)."""
        self._kick.set()

    async def start(self) -> None:
        self._task = asyncio.create_task(self._loop(), name="tokenizer-store")

    async def stop(self) -> None:
        if self._task is not None:
            await cancel_and_wait([self._task])
            self._task = None

    async def refresh(self) -> None:
        """One pass: load what is new or changed, drop what left the catalog."""
        self.passes += 1
        wanted = set(self.models())
        for m in [m for m in self._loaded if m not in wanted]:
            del self._loaded[m]
        if self._store is None:
            try:
                self._store = await self.js.object_store(self.subjects.bucket_tokenizers)
            except NotFoundError:
                return  # no agent has published a tokenizer yet
        for model in sorted(wanted):
            await self._refresh_one(self._store, model)

    async def _refresh_one(self, store: ObjectStore, model: str) -> None:
        try:
            info = await store.get_info(model)
        except NotFoundError:
            # No object (yet, or any more): keep what is loaded; an agent may be about to put it again.
            return
        digest = info.digest or f"{info.nuid}"
        have = self._loaded.get(model)
        if have is not None and have.digest == digest:
            return
        if info.size is not None and info.size > self.max_bytes:
            self._failed(model, digest, f"{info.size} bytes, more than {self.max_bytes}")
            return
        try:
            got = await store.get(model)
        except NotFoundError:
            return
        except nats.errors.Error as e:
            # Includes a digest mismatch (a half-written object): read again on the next pass.
            log.info(
                "tokenizer of %s: reading it failed (%s), again next pass", visible(model), type(e).__name__
            )
            return
        data = got.data or b""
        try:
            tok_info, files = read_bundle(data)
            if tok_info.model != model:
                raise BundleError(f"the info is of model {tok_info.model!r}")
            # Models with the same files (a base and its fine-tunes, one model under two names) share one
            # tokenizer: a 30 MB tokenizer.json costs ~100 MB built, once.
            same = self._same_files(tok_info)
            # Off the event loop: parsing a 30 MB tokenizer.json takes a while.
            tok = same if same is not None else await asyncio.to_thread(self.build, tok_info, files)
        except ValueError as e:  # BundleError, or the builder refusing the files
            self._failed(model, digest, str(e))
            return
        self._loaded[model] = _Loaded(digest, tok, tok_info.kind, _files_key(tok_info))
        self.loads += 1
        log.info("tokenizer of %s loaded (%s, %d files)", visible(model), tok_info.kind.value, len(files))

    def _same_files(self, info: TokenizerInfo) -> PromptTokenizer | None:
        key = _files_key(info)
        for got in self._loaded.values():
            if got.tokenizer is not None and got.files == key:
                return got.tokenizer
        return None

    def _failed(self, model: str, digest: str, why: str) -> None:
        self.failures += 1
        log.warning("tokenizer of %s not usable: %s", visible(model), visible(why))
        # Remembered by digest, so it is not read again until the object changes; what was loaded before
        # goes too: an object that changed no longer describes the engine's tokenizer.
        self._loaded[model] = _Loaded(digest, None, None)

    async def _loop(self) -> None:
        while True:
            try:
                await self.refresh()
            except (nats.errors.Error, TimeoutError) as e:
                # The bus is away or the bucket went: the next pass tries again, what is loaded stays.
                log.info("tokenizer store pass failed (%s)", type(e).__name__)
                self._store = None
            self._kick.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._kick.wait(), self.poll_s)
