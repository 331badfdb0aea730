"""--lora-resolver-dir (vLLM's filesystem resolver): which directory entries are adapters of this
base model, and the flag's checks. Loading on demand through a real server: test_lora_router.py."""
from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from kvmesh.api.errors import APIError
from kvmesh.api.lora import ServedLoRAs
from kvmesh.api.lora_resolver import ENV_DIR, FilesystemResolver
from kvmesh.common.config import EngineConfig
from kvmesh.engine.async_engine import AsyncLLMEngine
from kvmesh.engine.engine import LLMEngine


def _adapter(root: Path, name: str, **config) -> Path:
    path = root / name
    path.mkdir(parents=True)
    (path / "adapter_config.json").write_text(json.dumps(config))
    return path


def test_find_a_lora_of_this_base_by_model_path_or_served_name(tmp_path):
    sql = _adapter(tmp_path, "sql", peft_type="LORA", base_model_name_or_path="/models/tiny")
    served = _adapter(tmp_path, "law", peft_type="LORA", base_model_name_or_path="tiny")
    r = FilesystemResolver(tmp_path, ("/models/tiny",))
    assert r.find("sql", "tiny") == str(sql)
    assert r.find("law", "tiny") == str(served)
    assert r.find("law", "other") is None


def test_find_refuses_what_is_no_lora_of_this_base(tmp_path):
    _adapter(tmp_path, "other-base", peft_type="LORA", base_model_name_or_path="/models/big")
    _adapter(tmp_path, "ia3", peft_type="IA3", base_model_name_or_path="/models/tiny")
    (tmp_path / "no-config").mkdir()
    (tmp_path / "bad-json").mkdir()
    (tmp_path / "bad-json" / "adapter_config.json").write_text("{not json")
    (tmp_path / "a-file").write_text("x")
    _adapter(tmp_path / "nested", "deep", peft_type="LORA", base_model_name_or_path="/models/tiny")
    _adapter(tmp_path.parent, "outside", peft_type="LORA", base_model_name_or_path="/models/tiny")
    r = FilesystemResolver(tmp_path, ("/models/tiny",))
    for name in ("other-base", "ia3", "no-config", "bad-json", "a-file", "missing",
                 "nested/deep", "../outside", "..", ".", ""):
        assert r.find(name, "tiny") is None, name


def test_flag_then_vllm_env_then_off(tmp_path, monkeypatch):
    monkeypatch.delenv(ENV_DIR, raising=False)
    assert FilesystemResolver.from_flag(None, ("m",), True) is None
    monkeypatch.setenv(ENV_DIR, str(tmp_path))
    assert FilesystemResolver.from_flag(None, ("m", ""), True) == FilesystemResolver(tmp_path, ("m",))
    other = tmp_path / "o"
    other.mkdir()
    assert FilesystemResolver.from_flag(str(other), ("m",), True).root == other
    with pytest.raises(ValueError, match=r"needs --enable-lora$"):
        FilesystemResolver.from_flag(str(other), ("m",), False)
    with pytest.raises(ValueError, match=r"is not a directory$"):
        FilesystemResolver.from_flag(str(tmp_path / "missing"), ("m",), True)


def test_a_resolver_dir_that_is_no_directory_is_a_cli_error(tmp_path):
    r = subprocess.run([sys.executable, "-m", "kvmesh.cli", "serve", "--enable-lora",
                        "--lora-resolver-dir", str(tmp_path / "missing"), "--allocator", "none",
                        "--log-level", "warning"],
                       capture_output=True, text=True, timeout=120, check=False)
    assert r.returncode == 2
    assert r.stderr.strip().endswith(f"kvmesh serve: error: --lora-resolver-dir: "
                                     f"{tmp_path / 'missing'} is not a directory")


def test_served_loras_resolve_loads_once_and_refuses_cleanly(llama_base, llama_adapters, tmp_path):
    """ServedLoRAs.resolve over a real AsyncLLMEngine: three concurrent first requests for one
    adapter load it once (one id, one engine load); an adapter that is found and refused (rank
    over --max-lora-rank) is a 400 that registers nothing; a name not found is None."""
    shutil.copytree(llama_adapters["o-down"], tmp_path / "od")
    shutil.copytree(llama_adapters["all"], tmp_path / "big")
    config = json.loads((tmp_path / "big" / "adapter_config.json").read_text())
    (tmp_path / "big" / "adapter_config.json").write_text(json.dumps({**config, "r": 32}))
    engine = AsyncLLMEngine(LLMEngine(EngineConfig(
        model=str(llama_base), enable_lora=True, max_loras=1, max_lora_rank=16, max_cpu_loras=2,
        dtype="float32", device="cpu", num_kv_blocks=16, block_size=4)))
    engine.start()
    loras = ServedLoRAs("tiny", resolver=FilesystemResolver(tmp_path, (str(llama_base),)))
    try:
        async def run():
            first = await asyncio.gather(*(loras.resolve(engine, "od") for _ in range(3)))
            with pytest.raises(APIError) as e:
                await loras.resolve(engine, "big")
            return first, e.value, await loras.resolve(engine, "missing")
        first, refused, missing = asyncio.run(run())
        assert [r.lora_int_id for r in first] == [1, 1, 1] and first[0].lora_path == str(tmp_path / "od")
        assert engine.engine.list_loras() == {1}
        assert (refused.status, refused.code) == (400, "invalid_lora_adapter")
        assert refused.message.startswith("LoRA adapter 'big' was found but could not be loaded: ")
        assert missing is None
        assert list(loras.adapters) == ["od"]
    finally:
        engine.shutdown()
