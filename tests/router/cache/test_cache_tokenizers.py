"""Tokenizers from the object store (llmgw_router.cache.tokenizers), on a real nats-server with JetStream."""

from __future__ import annotations

import io
import zipfile
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest
from nats.aio.client import Client as NATS
from nats.js.object_store import ObjectStore
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import Whitespace

from llmgw_common import simtokens
from llmgw_common.codec import encode
from llmgw_common.kvcache import TokenizerInfo, TokenizerKind
from llmgw_common.subjects import Subjects
from llmgw_router.cache.tokenizers import (
    INFO_ENTRY,
    BundleError,
    PromptTokenizer,
    SimPromptTokenizer,
    TokenizerStore,
    build_tokenizer,
    read_bundle,
)
from tests.kit.poll import eventually
from tests.router.cache.cache_helpers import bundle

pytestmark = pytest.mark.slow

CHAT = {
    "model": "m",
    "messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}],
}


def tiny_tokenizer_json() -> bytes:
    tok = Tokenizer(WordLevel({"[UNK]": 0, "hello": 1, "world": 2}, unk_token="[UNK]"))
    tok.pre_tokenizer = Whitespace()  # type: ignore[assignment]
    return tok.to_str().encode()


def test_read_bundle_refuses_what_it_cannot_use() -> None:
    tj = tiny_tokenizer_json()
    info, files = read_bundle(bundle("m", TokenizerKind.HF, {"tokenizer.json": tj}))
    assert info.kind is TokenizerKind.HF and files == {"tokenizer.json": tj}
    with pytest.raises(BundleError, match="not a zip"):
        read_bundle(b"PK garbage")
    with pytest.raises(BundleError, match="sha256"):
        read_bundle(bundle("m", TokenizerKind.HF, {"tokenizer.json": tj}, lie=True))
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        z.writestr("tokenizer.json", tj)
    with pytest.raises(BundleError, match=r"no llmgw-tokenizer\.msgpack"):
        read_bundle(buf.getvalue())
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        z.writestr(
            INFO_ENTRY, encode(TokenizerInfo(model="m", kind=TokenizerKind.HF, files={"a.json": "00"}))
        )
    with pytest.raises(BundleError, match="no such entry"):
        read_bundle(buf.getvalue())
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        z.writestr(INFO_ENTRY, b"\xc1")
    with pytest.raises(BundleError, match="not msgpack"):
        read_bundle(buf.getvalue())
    # An HF bundle whose tokenizer.json does not parse is a ValueError, not whatever tokenizers raises.
    with pytest.raises(BundleError, match="does not build"):
        build_tokenizer(info, {"tokenizer.json": b"{not json"})


def test_the_sim_tokenizer_is_simtokens() -> None:
    tok = build_tokenizer(TokenizerInfo(model="m", kind=TokenizerKind.SIM), {})
    assert isinstance(tok, SimPromptTokenizer)
    assert tok.prompt_ids(CHAT) == simtokens.prompt_token_ids(CHAT) is not None


Store = Callable[..., Awaitable[TokenizerStore]]


@pytest.fixture
async def objects(nc: NATS, prefix: str) -> AsyncIterator[ObjectStore]:
    js = nc.jetstream()
    yield await js.create_object_store(Subjects(prefix).bucket_tokenizers)
    await js.delete_object_store(Subjects(prefix).bucket_tokenizers)


@pytest.fixture
async def store(nc: NATS, prefix: str) -> AsyncIterator[Store]:
    started: list[TokenizerStore] = []

    async def make(models: list[str], **kw: object) -> TokenizerStore:
        s = TokenizerStore(nc.jetstream(), Subjects(prefix), lambda: models, poll_s=0.1, **kw)  # type: ignore[arg-type]
        await s.start()
        started.append(s)
        return s

    yield make
    for s in started:
        await s.stop()


async def test_tokenizers_load_in_the_background_and_follow_their_objects(
    objects: ObjectStore, store: Store, caplog: pytest.LogCaptureFixture
) -> None:
    await objects.put("sim-model", bundle("sim-model", TokenizerKind.SIM))
    await objects.put(
        "hf-model", bundle("hf-model", TokenizerKind.HF, {"tokenizer.json": tiny_tokenizer_json()})
    )
    models = ["sim-model", "hf-model", "no-object"]
    s = await store(models)
    await eventually(lambda: s.loaded() == ["hf-model", "sim-model"], what="both tokenizers loaded")
    sim, hf = s.get("sim-model"), s.get("hf-model")
    assert sim is not None and hf is not None and s.get("no-object") is None
    assert sim.prompt_ids(CHAT) == simtokens.prompt_token_ids(CHAT)
    assert hf.prompt_ids({"model": "hf-model", "prompt": "hello world nope"}) == [1, 2, 0]
    assert s.kind("hf-model") is TokenizerKind.HF
    # The object changes: the new version is loaded, and only it is kept.
    await objects.put(
        "sim-model", bundle("sim-model", TokenizerKind.HF, {"tokenizer.json": tiny_tokenizer_json()})
    )
    await eventually(lambda: s.kind("sim-model") is TokenizerKind.HF, what="the changed object reloaded")
    # A broken version: counted once, the model goes by load, and it is not read again and again.
    await objects.put("hf-model", b"not a zip at all")
    await eventually(lambda: s.get("hf-model") is None, what="the broken version dropped")
    passes = s.passes
    await eventually(lambda: s.passes >= passes + 3, what="three more passes")
    assert s.failures == 1
    assert sum("not usable" in r.message for r in caplog.records) == 1
    # A bundle naming another model is refused.
    await objects.put("hf-model", bundle("hf-model", TokenizerKind.SIM, info_model="imposter"))
    await eventually(lambda: s.failures == 2, what="the imposter refused")
    assert s.get("hf-model") is None
    # A model that leaves the catalog is forgotten.
    models.remove("sim-model")
    s.kick()
    await eventually(lambda: s.loaded() == [], what="sim-model dropped")


async def test_an_object_too_large_is_not_read(objects: ObjectStore, store: Store) -> None:
    await objects.put("m", bundle("m", TokenizerKind.HF, {"tokenizer.json": tiny_tokenizer_json()}))
    s = await store(["m"], max_bytes=100)
    await eventually(lambda: s.failures == 1, what="the object refused by its size")
    assert s.get("m") is None


async def test_no_bucket_yet_then_one(nc: NATS, prefix: str, store: Store) -> None:
    s = await store(["m"])
    await eventually(lambda: s.passes >= 3, what="passes without a bucket")
    assert s.loaded() == [] and s.failures == 0
    js = nc.jetstream()
    objects = await js.create_object_store(Subjects(prefix).bucket_tokenizers)
    try:
        await objects.put("m", bundle("m", TokenizerKind.SIM))
        await eventually(lambda: s.loaded() == ["m"], what="the tokenizer once the bucket exists")
    finally:
        await js.delete_object_store(Subjects(prefix).bucket_tokenizers)


async def test_models_with_the_same_files_share_one_tokenizer(objects: ObjectStore, store: Store) -> None:
    files = {"tokenizer.json": tiny_tokenizer_json()}
    for m in ("base", "base-ft"):
        await objects.put(m, bundle(m, TokenizerKind.HF, files))
    await objects.put(
        "other", bundle("other", TokenizerKind.HF, {"tokenizer.json": tiny_tokenizer_json() + b" "})
    )
    built: list[str] = []

    def build(info: TokenizerInfo, fs: dict[str, bytes]) -> PromptTokenizer:
        built.append(info.model)
        return build_tokenizer(info, fs)

    s = await store(["base", "base-ft", "other"], build=build)
    await eventually(lambda: s.loaded() == ["base", "base-ft", "other"], what="all three loaded")
    assert s.get("base") is s.get("base-ft") and s.get("other") is not s.get("base")
    assert len(built) == 2
