"""Whether one weight file is whole: safetensors and GGUF, judged from their own headers.

Both formats say, in their header, where every tensor's bytes end; a file shorter than that is a
download cut short or still running, not weights (ARCHITECTURE #5).
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any, BinaryIO


def safetensors_problem(path: Path) -> str | None:
    """Why a .safetensors file is not complete, or None: its header names every tensor's byte range."""
    try:
        size = path.stat().st_size
        with path.open("rb") as f:
            head = f.read(8)
            if len(head) < 8:
                return f"{path.name}: truncated ({size} bytes)"
            (n,) = struct.unpack("<Q", head)
            if n > size - 8 or n > 100 * 1024 * 1024:
                return f"{path.name}: truncated (header of {n} bytes, file of {size})"
            header = json.loads(f.read(n))
    except OSError as e:
        return f"{path.name}: unreadable ({e.strerror or e})"
    except (ValueError, UnicodeDecodeError):
        return f"{path.name}: not a safetensors file (bad header)"
    if not isinstance(header, dict):
        return f"{path.name}: not a safetensors file (bad header)"
    end = 0
    for key, info in header.items():
        if key == "__metadata__":
            continue
        try:
            end = max(end, int(info["data_offsets"][1]))
        except (KeyError, IndexError, TypeError, ValueError):
            return f"{path.name}: not a safetensors file (tensor {key} has no data offsets)"
    if 8 + n + end > size:
        return f"{path.name}: truncated ({size} of {8 + n + end} bytes)"
    return None


# ggml tensor types: (elements per block, bytes per block), as in llama.cpp's gguf-py constants.
GGML_BLOCKS: dict[int, tuple[int, int]] = {
    0: (1, 4), 1: (1, 2), 2: (32, 18), 3: (32, 20), 6: (32, 22), 7: (32, 24), 8: (32, 34), 9: (32, 36),
    10: (256, 84), 11: (256, 110), 12: (256, 144), 13: (256, 176), 14: (256, 210), 15: (256, 292),
    16: (256, 66), 17: (256, 74), 18: (256, 98), 19: (256, 50), 20: (32, 18), 21: (256, 110),
    22: (256, 82), 23: (256, 136), 24: (1, 1), 25: (1, 2), 26: (1, 4), 27: (1, 8), 28: (1, 8),
    29: (256, 56), 30: (1, 2), 34: (256, 54), 35: (256, 66), 39: (32, 17),
}  # fmt: skip

# GGUF metadata value types with a fixed size: type -> struct format.
_GGUF_SCALARS: dict[int, str] = {
    0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d",
}  # fmt: skip
_GGUF_STRING, _GGUF_ARRAY = 8, 9


class _Truncated(Exception):
    pass


class _GgufReader:
    """Little-endian reads over the head of a file, raising _Truncated past its end.

    The head is read into memory as far as it is parsed (not mapped: a file cut short while mapped
    would kill the agent with SIGBUS). Strings of a tokenizer's vocabulary, hundreds of thousands of
    them, are skipped by offset, which keeps a 256k-token GGUF at tens of milliseconds.
    """

    def __init__(self, f: BinaryIO) -> None:
        self.f = f
        self.buf = bytearray()
        self.pos = 0
        self.eof = False

    def ensure(self, end: int) -> None:
        while len(self.buf) < end and not self.eof:
            chunk = self.f.read(max(1 << 20, end - len(self.buf)))
            self.eof = not chunk
            self.buf += chunk
        if len(self.buf) < end:
            raise _Truncated

    def take(self, n: int) -> bytes:
        end = self.pos + n
        self.ensure(end)
        b = bytes(self.buf[self.pos : end])
        self.pos = end
        return b

    def scalar(self, fmt: str) -> Any:
        size = struct.calcsize(fmt)
        self.ensure(self.pos + size)
        (v,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += size
        return v

    def string(self) -> str:
        return self.take(self.scalar("<Q")).decode("utf-8", errors="replace")

    def value(self, vtype: int) -> Any:
        if vtype in _GGUF_SCALARS:
            return self.scalar(_GGUF_SCALARS[vtype])
        if vtype == _GGUF_STRING:
            return self.string()
        if vtype == _GGUF_ARRAY:
            etype, count = self.scalar("<I"), self.scalar("<Q")
            if etype in _GGUF_SCALARS:
                # Only the extent of token scores and types matters.
                self.take(struct.calcsize(_GGUF_SCALARS[etype]) * count)
            elif etype == _GGUF_STRING:
                unpack, buf, pos, have = struct.unpack_from, self.buf, self.pos, len(self.buf)
                for _ in range(count):
                    if pos + 8 > have:
                        self.ensure(pos + 8)
                        buf, have = self.buf, len(self.buf)
                    pos += 8 + unpack("<Q", buf, pos)[0]
                self.pos = pos
                self.ensure(pos)
            else:
                for _ in range(count):
                    self.value(etype)
            return None
        raise ValueError(f"unknown metadata type {vtype}")


def gguf_problem(path: Path) -> str | None:
    """Why a .gguf file is not complete weights, or None.

    Reads the header, the metadata and the tensor table, and checks that the file is as long as its
    last tensor says. A tensor of a type this table does not know only gets the header checks.
    """
    try:
        size = path.stat().st_size
        with path.open("rb") as f:
            r = _GgufReader(f)
            if r.take(4) != b"GGUF":
                return f"{path.name}: not a GGUF file (bad magic)"
            version = r.scalar("<I")
            if version not in (2, 3):
                return f"{path.name}: GGUF version {version} is not supported"
            n_tensors, n_kv = r.scalar("<Q"), r.scalar("<Q")
            alignment = 32
            for _ in range(n_kv):
                key = r.string()
                value = r.value(r.scalar("<I"))
                if key == "general.alignment" and isinstance(value, int) and value > 0:
                    alignment = value
            end = 0
            known = True
            for _ in range(n_tensors):
                r.string()
                dims = [r.scalar("<Q") for _ in range(r.scalar("<I"))]
                ttype, offset = r.scalar("<I"), r.scalar("<Q")
                block = GGML_BLOCKS.get(ttype)
                if block is None:
                    known = False
                    continue
                elements = 1
                for d in dims:
                    elements *= d
                end = max(end, offset + elements // block[0] * block[1])
            data_start = -(-r.pos // alignment) * alignment
    except OSError as e:
        return f"{path.name}: unreadable ({e.strerror or e})"
    except _Truncated:
        return f"{path.name}: truncated (ends inside its header, {size} bytes)"
    except ValueError as e:
        return f"{path.name}: not a GGUF file ({e})"
    if n_tensors == 0:
        return f"{path.name}: holds no tensors"
    if known and data_start + end > size:
        return f"{path.name}: truncated ({size} of {data_start + end} bytes)"
    if data_start > size:
        return f"{path.name}: truncated ({size} bytes, data would start at {data_start})"
    return None
