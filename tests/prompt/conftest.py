"""Fixtures for the prompt tests: the built-in GGUF and its converted tokenizer directory (no
weights loaded for either)."""
from __future__ import annotations

from pathlib import Path

import pytest

from kvmesh.common.model_files import builtin_model_path
from kvmesh.prompt.sources import gguf_tokenizer_dir


@pytest.fixture(scope="session")
def builtin_path() -> Path:
    return builtin_model_path()


@pytest.fixture(scope="session")
def smollm_tokenizer_dir(builtin_path) -> Path:
    """The cached tokenizer.json + tokenizer_config.json converted from the built-in GGUF."""
    path = gguf_tokenizer_dir(builtin_path)
    assert (path / "tokenizer.json").is_file()
    return path
