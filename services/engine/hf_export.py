"""A GGUF model as a Hugging Face directory, converted once and cached: what other engines load.

    from kvmesh.engine.hf_export import builtin_hf_dir
    path = builtin_hf_dir()          # ~/.cache/kvmesh/<gguf key>-hf-float32/

vLLM (and anything else that reads HF checkpoints) cannot load the built-in Q4_1 GGUF; this
writes the weights transformers dequantizes from it (`from_pretrained(dir, gguf_file=...)`) as
`model.safetensors` in one dtype, a `config.json` that names `LlamaForCausalLM` without the GGUF
quantization entry, and the tokenizer files kvmesh converts from the same GGUF. kvmesh's own
GGUF loader dequantizes to the same values, so both engines run the same float32 model.

Torch and transformers are imported only when a conversion runs (a warm cache needs neither).
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

from kvmesh.common.model_files import builtin_model_path, cache_dir

HF_DTYPES = ("float32", "bfloat16", "float16")
_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")


def builtin_hf_dir(dtype: str = "float32", cache_root: Path | None = None) -> Path:
    """The built-in SmolLM2 GGUF as an HF directory in `dtype` (converted on first use)."""
    return gguf_to_hf_dir(builtin_model_path(), dtype, cache_root)


def gguf_to_hf_dir(path: Path, dtype: str = "float32", cache_root: Path | None = None) -> Path:
    """The GGUF file `path` as an HF directory under `cache_root` (default: cache_dir()).

    The directory appears atomically (written beside it, then renamed), so concurrent callers
    and an interrupted conversion never leave a half-written model behind.
    """
    from kvmesh.prompt.sources import cache_key, gguf_tokenizer_dir

    if dtype not in HF_DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(HF_DTYPES)}, got {dtype!r}")
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file {path} does not exist")
    cache_root = cache_dir() if cache_root is None else Path(cache_root)
    target = cache_root / f"{cache_key(path)}-hf-{dtype}"
    if all((target / name).is_file() for name in _FILES):
        return target
    tokenizer_dir = gguf_tokenizer_dir(path, cache_root)
    cache_root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".tmp-hf-", dir=cache_root))
    try:
        _convert(path, dtype, tmp)
        for name in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(tokenizer_dir / name, tmp / name)
        shutil.rmtree(target, ignore_errors=True)      # a partial directory from an old layout
        try:
            os.rename(tmp, target)
        except OSError:
            if not all((target / name).is_file() for name in _FILES):   # not a lost race
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def _convert(path: Path, dtype: str, out: Path) -> None:
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                 dtype=getattr(torch, dtype), local_files_only=True)
    # NOTE: save_pretrained refuses a GGUF-loaded model; the state dict is written directly.
    # A tied lm_head shares the embedding's storage, which safetensors refuses: HF checkpoints
    # leave it out and the config's tie_word_embeddings restores it.
    state = model.state_dict()
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    save_file({k: v.detach().to(getattr(torch, dtype)).contiguous() for k, v in state.items()},
              str(out / "model.safetensors"), metadata={"format": "pt"})
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    config["architectures"] = [type(model).__name__]
    config["dtype"] = config["torch_dtype"] = dtype
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
