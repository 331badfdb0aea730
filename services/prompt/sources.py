"""Where a tokenizer comes from, without loading weights (or torch): an HF directory's
tokenizer.json, or a GGUF file's tokenizer converted once by transformers and cached under
${KVMESH_CACHE_DIR:-~/.cache/kvmesh}.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import tempfile
from pathlib import Path

from kvmesh.common.gguf_reader import open_gguf
from kvmesh.common.model_files import BUILTIN_MODEL_NAME, builtin_model_path, cache_dir
from kvmesh.common.storage import fetch, is_uri
from kvmesh.prompt.tokenizer import Tokenizer


def load_tokenizer(model: str | None, tokenizer: str | None = None,
                   extra_eos_token_ids: tuple[int, ...] = ()) -> Tokenizer:
    """The `Tokenizer` for `tokenizer` (a directory) or `model` (a directory, a .gguf file, an
    s3:// / hf:// / pvc:// source, None or the built-in model's name). Raises FileNotFoundError /
    ValueError (a FetchError for a source) when there is none."""
    if tokenizer:
        return Tokenizer.from_dir(Path(tokenizer).expanduser(), extra_eos_token_ids)
    if not model or model == BUILTIN_MODEL_NAME:
        path = builtin_model_path()
    elif is_uri(model):
        # NOTE: the router takes the engines' --model as is: s3:// / hf:// come through the
        # node's model cache (where an engine on the node has fetched it, a cache hit)
        path = fetch(model).path
    else:
        path = Path(model).expanduser()
        if not path.exists():
            raise FileNotFoundError(
                f"model {model!r} is neither a directory nor a .gguf file here; pass the model "
                "path (or --tokenizer DIR) so the router hashes prompts like the engines do")
    if path.is_dir():
        return Tokenizer.from_dir(path, extra_eos_token_ids)
    return Tokenizer.from_dir(gguf_tokenizer_dir(path), extra_eos_token_ids)


def gguf_tokenizer_dir(path: Path, cache_root: Path | None = None) -> Path:
    """Directory with tokenizer.json + tokenizer_config.json for the GGUF file `path`, converted
    once and cached under `cache_root` (default: cache_dir()). A warm cache reads 1 MiB of the file."""
    cache_root = cache_dir() if cache_root is None else cache_root
    target = cache_root / cache_key(path)
    if (target / "tokenizer.json").is_file() and (target / "tokenizer_config.json").is_file():
        return target
    reader = open_gguf(path)
    if reader.get("tokenizer.ggml.model") is None:
        raise ValueError(f"GGUF file {path} has no tokenizer metadata (tokenizer.ggml.*)")
    template = reader.get("tokenizer.chat_template")
    cache_root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=cache_root))
    try:
        _convert_tokenizer(path, template, tmp)
        try:
            os.rename(tmp, target)  # atomic: readers see all files or none
        except OSError:
            if not (target / "tokenizer.json").is_file():  # not a lost race: a real error
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def cache_key(path: Path) -> str:
    """Stable per file: name, size and the sha256 of the first MiB (cheap; no full hash)."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        digest = hashlib.sha256(f.read(1 << 20)).hexdigest()[:16]
    stem = re.sub(r"[^A-Za-z0-9._-]", "_", path.stem)
    return f"{stem}-{size}-{digest}"


def _convert_tokenizer(path: Path, chat_template: str | None, out: Path) -> None:
    from transformers import AutoTokenizer  # noqa: PLC0415

    # NOTE: transformers' GGUF converter is the tested path from llama.cpp vocab to a
    # tokenizers BPE/Unigram model; we only keep its output and the metadata's template.
    hf = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name, local_files_only=True)
    hf.save_pretrained(str(out))
    (out / "chat_template.jinja").unlink(missing_ok=True)
    config = {k: getattr(hf, k) for k in ("bos_token", "eos_token", "unk_token", "pad_token")
              if getattr(hf, k, None) is not None}
    if chat_template is not None:
        config["chat_template"] = chat_template
    config["source_gguf"] = str(path)
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
