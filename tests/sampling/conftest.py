"""Tokenizers for the detokenizer tests: a small byte-level BPE trained here (always), and the
real SmolLM2 tokenizer when the model cache holds one (optional, skipped otherwise)."""
from __future__ import annotations

import glob
import os

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

EOS = "<|endoftext|>"
IM_START = "<|im_start|>"
_CORPUS = [
    "héllo wörld 你好 🙂",
    "the quick brown fox jumps over the lazy dog",
    "hello world, hello again; stop here",
    "naïve café résumé — 10 € please",
    "你好世界 🙂🙃 good bye",
]


def _build_bpe() -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=[EOS, IM_START], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_CORPUS * 10, trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token=EOS, additional_special_tokens=[IM_START],
        clean_up_tokenization_spaces=False)


def _smollm2_dir() -> str | None:
    root = os.environ.get("KVMESH_CACHE_DIR") or os.path.expanduser("~/.cache/kvmesh")
    for path in sorted(glob.glob(os.path.join(root, "*", "tokenizer.json"))):
        if "smollm2" in path.lower():
            return os.path.dirname(path)
    return None


@pytest.fixture(scope="session")
def bpe() -> PreTrainedTokenizerFast:
    return _build_bpe()


@pytest.fixture(scope="session", params=["bpe", "smollm2"])
def any_tokenizer(request, bpe):
    if request.param == "bpe":
        return bpe
    path = _smollm2_dir()
    if path is None:
        pytest.skip("no SmolLM2 tokenizer in the kvmesh model cache")
    return AutoTokenizer.from_pretrained(path, local_files_only=True)
