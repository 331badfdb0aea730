"""Session fixtures of tests/lora: a tiny Llama base model and three adapters made by peft."""
from __future__ import annotations

from pathlib import Path

import pytest
from lora_adapters import LLAMA_TARGETS, make_adapter, make_base


@pytest.fixture(scope="session")
def llama_base(tmp_path_factory) -> Path:
    return make_base("llama", tmp_path_factory.mktemp("lora") / "llama")


@pytest.fixture(scope="session")
def llama_adapters(llama_base, tmp_path_factory) -> dict[str, Path]:
    """Three adapters of different ranks, scalings and targets on the Llama base."""
    root = tmp_path_factory.mktemp("adapters")
    return {
        "all": make_adapter(llama_base, root / "all", LLAMA_TARGETS, r=8, alpha=16, seed=1),
        "qv-rslora": make_adapter(llama_base, root / "qv", ["q_proj", "v_proj"], r=4, alpha=8,
                                  use_rslora=True, seed=2),
        "o-down": make_adapter(llama_base, root / "od", ["o_proj", "down_proj"], r=16, alpha=8,
                               seed=3),
    }
