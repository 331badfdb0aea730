"""Tiny random HF checkpoints (config -> transformers model -> saved directory) for engine tests.

`save_tiny_model` writes a seeded random transformers model and a word-level tokenizer of the
same vocabulary (`<unk>`, `<s>`, `</s>`, then `w3`, `w4`, ...), so a test needs neither a
download nor the built-in model's 49k-token tokenizer.
"""
from __future__ import annotations

from pathlib import Path

import torch


def tiny_tokenizer(path: Path, vocab_size: int) -> None:
    """tokenizer.json + tokenizer_config.json: one word per id, split on whitespace."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers  # noqa: PLC0415
    from transformers import PreTrainedTokenizerFast  # noqa: PLC0415

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, vocab_size)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")   # joins words with spaces
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    fast.save_pretrained(path)


def randomize(model: torch.nn.Module, seed: int, scale: float = 0.15) -> None:
    """HF inits norms to 1 (and some weights to 0): make every tensor matter, logits well separated."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            p.copy_(1.0 + 0.1 * noise if "norm" in name else scale * noise)


def save_tiny_model(model: torch.nn.Module, path: Path, seed: int = 1) -> Path:
    """Randomise `model` (seeded), save it with a matching tokenizer; returns `path`."""
    randomize(model, seed)
    model.eval()
    model.save_pretrained(path)
    tiny_tokenizer(path, model.config.vocab_size)
    return path
