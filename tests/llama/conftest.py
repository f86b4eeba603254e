"""The llama.cpp tests' two inputs, each skipping with the way to get it when absent."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.llama.llama_kit import ENABLE_HINT, find_gguf, find_llama_server


@pytest.fixture
def llama_server() -> Path:
    path, why = find_llama_server()
    if path is None:
        pytest.skip(f"no llama-server ({why}): {ENABLE_HINT}")
    return path


@pytest.fixture
def gguf() -> Path:
    path, why = find_gguf()
    if path is None:
        pytest.skip(f"no Gemma 3 270M GGUF ({why}): {ENABLE_HINT}")
    return path
