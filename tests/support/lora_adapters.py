"""Tiny seeded base models of two families and PEFT adapters made on them with `peft`, for
tests/lora (its conftest.py holds the shared fixtures).

Llama has separate q/k/v and gate/up projections (each its own part of a fused site); Phi-3
stores qkv_proj and gate_up_proj fused in the checkpoint (one part each). The adapters are
`LoraConfig(init_lora_weights=False)`: B is random, so every adapter changes the outputs.
"""
from __future__ import annotations

from pathlib import Path

import torch
from tiny_models import save_tiny_model

VOCAB = 256
LLAMA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
PHI3_TARGETS = ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]


def _config(family: str):
    from transformers import LlamaConfig, Phi3Config
    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                  bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False)
    return LlamaConfig(**common) if family == "llama" else Phi3Config(**common)


def make_base(family: str, path: Path, seed: int = 3) -> Path:
    from transformers import AutoModelForCausalLM
    torch.manual_seed(seed)
    return save_tiny_model(AutoModelForCausalLM.from_config(_config(family)), path, seed=seed)


def load_hf(path: Path):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()


def make_adapter(base: Path, path: Path, targets: list[str], r: int = 8, alpha: int = 16,
                 use_rslora: bool = False, seed: int = 0) -> Path:
    """A PEFT adapter saved with peft itself (adapter_config.json + adapter_model.safetensors)."""
    from peft import LoraConfig, get_peft_model
    torch.manual_seed(seed)
    cfg = LoraConfig(r=r, lora_alpha=alpha, target_modules=targets, use_rslora=use_rslora,
                     init_lora_weights=False, lora_dropout=0.0, bias="none", task_type="CAUSAL_LM")
    get_peft_model(load_hf(base), cfg).save_pretrained(str(path))
    return path


def merged(base: Path, adapter: Path | None):
    """transformers' model with the adapter merged by peft (None: the base model)."""
    if adapter is None:
        return load_hf(base)
    from peft import PeftModel
    return PeftModel.from_pretrained(load_hf(base), str(adapter)).merge_and_unload().eval()


def greedy(model, prompt: list[int], new_tokens: int) -> list[int]:
    """Plain greedy decoding, the whole sequence each step (tiny models), no EOS stop."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(new_tokens):
            logits = model(input_ids=torch.tensor([ids])).logits[0, -1]
            ids.append(int(torch.argmax(logits)))
    return ids[len(prompt):]
