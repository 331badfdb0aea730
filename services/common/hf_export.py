"""A GGUF model as a Hugging Face directory (config.json, model.safetensors, tokenizer), for peers
that load only HF checkpoints: vLLM in `make test-vllm` and the throughput benchmark's peers.

Converted once per file and dtype, cached under ${KVMESH_CACHE_DIR:-~/.cache/kvmesh} as
`{cache_key}-hf-{dtype}` beside the cached tokenizer. transformers dequantizes the GGUF weights
(`from_pretrained(dir, gguf_file=...)`); its save_pretrained refuses a GGUF-loaded model, so the
state dict is written with safetensors directly. The tokenizer files are the ones every kvmesh
component uses (kvmesh.prompt.sources), chat template included, so a peer renders chats alike.
Torch is imported only when a conversion runs.
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

from kvmesh.common.model_files import builtin_model_path, cache_dir

_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")
_DTYPES = ("float32", "bfloat16", "float16")


def hf_model_dir(gguf: str | Path | None = None, dtype: str = "float32",
                 cache_root: Path | None = None) -> Path:
    """The HF directory of `gguf` (default: the built-in model) in `dtype`, converting it on the
    first call. ValueError for an unknown dtype; FileNotFoundError for a missing file."""
    from kvmesh.prompt.sources import cache_key, gguf_tokenizer_dir  # noqa: PLC0415

    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(_DTYPES)}, got {dtype!r}")
    path = builtin_model_path() if gguf is None else Path(gguf).expanduser()
    if not path.is_file():
        raise FileNotFoundError(f"no GGUF file at {path}")
    root = cache_dir() if cache_root is None else cache_root
    target = root / f"{cache_key(path)}-hf-{dtype}"
    if all((target / f).is_file() for f in _FILES):
        return target
    tokenizer = gguf_tokenizer_dir(path, root)
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".tmp-hf-", dir=root))
    try:
        _convert_weights(path, dtype, tmp)
        for name in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(tokenizer / name, tmp / name)
        try:
            os.rename(tmp, target)       # atomic: readers see every file or none
        except OSError:
            if not all((target / f).is_file() for f in _FILES):    # not a lost race
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def _convert_weights(path: Path, dtype: str, out: Path) -> None:
    import torch  # noqa: PLC0415
    from safetensors.torch import save_file  # noqa: PLC0415
    from transformers import AutoModelForCausalLM  # noqa: PLC0415

    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                 dtype=getattr(torch, dtype))
    state = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        # NOTE: safetensors refuses shared tensors; a tied head is rebuilt from the embedding
        state.pop("lm_head.weight", None)
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    config["architectures"] = [type(model).__name__]
    config["torch_dtype"] = config["dtype"] = dtype
    (out / "config.json").write_text(json.dumps(config, indent=2, default=str))
