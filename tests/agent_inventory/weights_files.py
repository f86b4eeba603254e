"""Writers for small but well-formed weight files: safetensors and GGUF, complete or cut short."""

from __future__ import annotations

import json
import struct
from pathlib import Path

F32, Q4_K = 0, 12


def safetensors_bytes(tensors: dict[str, int]) -> bytes:
    """A safetensors file holding F32 tensors of the given element counts."""
    header: dict[str, object] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, n in tensors.items():
        header[name] = {"dtype": "F32", "shape": [n], "data_offsets": [offset, offset + 4 * n]}
        offset += 4 * n
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw + b"\0" * offset


def _gguf_string(s: str) -> bytes:
    b = s.encode()
    return struct.pack("<Q", len(b)) + b


def gguf_bytes(
    version: int = 3, tensors: tuple[tuple[str, tuple[int, ...], int], ...] | None = None
) -> bytes:
    """A GGUF file: metadata (architecture, alignment, a token array) and tensors, data included."""
    tensors = tensors if tensors is not None else (("tok_embd", (64, 4), F32), ("blk.0.ffn", (256, 2), Q4_K))
    sizes = {F32: lambda n: 4 * n, Q4_K: lambda n: n // 256 * 144}
    kv = [
        _gguf_string("general.architecture") + struct.pack("<I", 8) + _gguf_string("llama"),
        _gguf_string("general.alignment") + struct.pack("<II", 4, 32),
        # An array of strings and one of floats, as a tokenizer stores them.
        _gguf_string("tokenizer.ggml.tokens")
        + struct.pack("<IIQ", 9, 8, 3)
        + b"".join(_gguf_string(t) for t in ("<s>", "</s>", "hi")),
        _gguf_string("tokenizer.ggml.scores") + struct.pack("<IIQ", 9, 6, 3) + struct.pack("<3f", 0, 0, 1),
    ]
    out = b"GGUF" + struct.pack("<IQQ", version, len(tensors), len(kv)) + b"".join(kv)
    data = b""
    for name, dims, ttype in tensors:
        n = 1
        for d in dims:
            n *= d
        offset = len(data)
        out += (
            _gguf_string(name) + struct.pack("<I", len(dims)) + b"".join(struct.pack("<Q", d) for d in dims)
        )
        out += struct.pack("<IQ", ttype, offset)
        data += b"\x01" * sizes.get(ttype, lambda n: 4 * n)(n)
        data += b"\0" * (-len(data) % 32)
    out += b"\0" * (-len(out) % 32)
    return out + data


def write(path: Path, content: bytes | str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(content, str):
        path.write_text(content)
    else:
        path.write_bytes(content)
    return path
