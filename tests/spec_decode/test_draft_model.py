"""Speculative decoding with a draft model made from the target by dropping layers: greedy output
token-identical to decoding without it (chunked prefill with prefix hits, recompute preemption);
a draft with another vocabulary or tokenizer is refused at start, naming the difference."""
from __future__ import annotations

import json

import pytest
import torch
from tiny_models import save_tiny_model, tiny_tokenizer

from kvmesh.common.config import EngineConfig
from kvmesh.engine.engine import LLMEngine

from .conftest import PROMPTS, VOCAB, greedy_requests, run_engine


@pytest.fixture(scope="module")
def draft_dir(tiny_llama, tmp_path_factory):
    """The tiny Llama with its second layer dropped (same embeddings, tokenizer, first layer)."""
    from transformers import LlamaForCausalLM
    path, _ = tiny_llama
    model = LlamaForCausalLM.from_pretrained(path, torch_dtype=torch.float32)
    model.model.layers = model.model.layers[:1]
    model.config.num_hidden_layers = 1
    out = tmp_path_factory.mktemp("draft") / "draft-1-layer"
    model.save_pretrained(out)
    tiny_tokenizer(out, VOCAB)
    return str(out)


def _spec(model: str) -> dict:
    return {"method": "draft_model", "model": model, "num_speculative_tokens": 3}


@pytest.mark.parametrize("cfg", [
    {"max_num_batched_tokens": 20, "block_size": 4, "num_kv_blocks": 256},
    {"num_kv_blocks": 14, "max_model_len": 112, "block_size": 8, "preemption_mode": "recompute"},
], ids=["chunked-prefix-cache", "recompute"])
def test_greedy_output_is_token_identical_with_a_draft_model(tiny_llama, draft_dir, cfg):
    _, loaded = tiny_llama
    base = run_engine(LLMEngine(EngineConfig(dtype="float32", **cfg), loaded=loaded),
                      greedy_requests())
    engine = LLMEngine(EngineConfig(dtype="float32", speculative_config=_spec(draft_dir), **cfg),
                       loaded=loaded)
    assert engine.draft.config.num_hidden_layers == 1
    spec = run_engine(engine, greedy_requests())
    assert {k: v[0].token_ids for k, v in spec.outputs.items()} == \
        {k: v[0].token_ids for k, v in base.outputs.items()}
    assert len(spec.outputs) == len(PROMPTS)
    assert spec.drafts > 0 and spec.accepted > 0, spec


def test_a_draft_with_another_vocab_size_is_refused(tiny_llama, tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM
    _, loaded = tiny_llama
    torch.manual_seed(0)
    other = save_tiny_model(LlamaForCausalLM(LlamaConfig(
        vocab_size=40, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=512)),
        tmp_path / "vocab40")
    with pytest.raises(ValueError, match=r"has vocab_size 40, the target .* 48"):
        LLMEngine(EngineConfig(dtype="float32", num_kv_blocks=16,
                               speculative_config=_spec(str(other))), loaded=loaded)


def test_a_draft_with_another_tokenizer_is_refused(tiny_llama, draft_dir, tmp_path):
    import shutil
    _, loaded = tiny_llama
    other = tmp_path / "renamed"
    shutil.copytree(draft_dir, other)
    tok = json.loads((other / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    vocab["x3"] = vocab.pop("w3")
    (other / "tokenizer.json").write_text(json.dumps(tok))
    with pytest.raises(ValueError, match=r"token 'w3' is id 3 in the target, None in the draft"):
        LLMEngine(EngineConfig(dtype="float32", num_kv_blocks=16,
                               speculative_config=_spec(str(other))), loaded=loaded)


def test_a_draft_model_with_tensor_parallelism_is_refused_before_any_worker_starts(draft_dir):
    with pytest.raises(ValueError, match="a draft model needs --tensor-parallel-size 1"):
        LLMEngine(EngineConfig(dtype="float32", num_kv_blocks=16, tensor_parallel_size=2,
                               speculative_config=_spec(draft_dir)))
