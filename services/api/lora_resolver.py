"""On-demand LoRA adapters from a directory (`--lora-resolver-dir`, or vLLM's
`VLLM_LORA_RESOLVER_CACHE_DIR`), as vLLM's filesystem resolver finds them.

A request naming a model this server does not serve names adapter `x`: if `DIR/x/` holds an
`adapter_config.json` whose `peft_type` is `LORA` and whose `base_model_name_or_path` is this
server's base model, the adapter is loaded through the same checked path as
`POST /v1/load_lora_adapter` (no admin key: whoever controls the directory controls the set),
then served. Anything else leaves the name unknown (a 404).
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

ENV_DIR = "VLLM_LORA_RESOLVER_CACHE_DIR"      # vLLM's variable, read when the flag is not given


@dataclass(frozen=True, slots=True)
class FilesystemResolver:
    root: Path                      # the directory of adapters, one sub-directory per name
    base_models: tuple[str, ...]    # the names `base_model_name_or_path` may give the base by

    @classmethod
    def from_flag(cls, directory: str | None, base_models: tuple[str, ...],
                  enable_lora: bool) -> FilesystemResolver | None:
        """The resolver of `--lora-resolver-dir` (else $VLLM_LORA_RESOLVER_CACHE_DIR); None when
        neither is set; ValueError when it is no directory or LoRA is off."""
        directory = directory or os.environ.get(ENV_DIR) or None
        if directory is None:
            return None
        if not enable_lora:
            raise ValueError("--lora-resolver-dir (or $VLLM_LORA_RESOLVER_CACHE_DIR) needs "
                             "--enable-lora")
        root = Path(directory)
        if not root.is_dir():
            raise ValueError(f"--lora-resolver-dir: {directory} is not a directory")
        return cls(root, tuple(b for b in base_models if b))

    def find(self, name: str, served_base: str) -> str | None:
        """The path of adapter `name` if the directory holds a LoRA adapter of this base model."""
        # NOTE: one path component only: a model name from a request never walks out of root
        if not name or name in (".", "..") or "/" in name or "\\" in name or "\0" in name:
            return None
        path = self.root / name
        try:
            config = json.loads((path / "adapter_config.json").read_text())
        except (OSError, ValueError):
            return None
        if not isinstance(config, dict) or config.get("peft_type") != "LORA":
            return None
        if config.get("base_model_name_or_path") not in (*self.base_models, served_base):
            return None
        return str(path)
