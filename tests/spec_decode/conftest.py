"""Tiny random checkpoints of two families for the speculative-decoding tests, and a runner
that drives an engine to completion and sums what speculation did."""
from __future__ import annotations

import random
from dataclasses import dataclass, field

import pytest
import torch
from tiny_models import save_tiny_model

VOCAB = 48       # small: a random model's greedy text soon repeats, so prompt lookup has hits


def _prompts() -> list[list[int]]:
    rng = random.Random(3)
    shared = [rng.randrange(3, VOCAB) for _ in range(20)]
    period = [rng.randrange(3, VOCAB) for _ in range(5)]
    out = [period * 4, period * 2 + period[:3]]                         # copy-heavy
    out += [[rng.randrange(3, VOCAB) for _ in range(n)] for n in (1, 6, 17, 33)]
    out += [shared + [rng.randrange(3, VOCAB) for _ in range(n)] for n in (2, 9)]   # prefix hits
    return out


PROMPTS = _prompts()


def greedy_requests(max_tokens: int = 16) -> list[tuple]:
    """(id, prompt, params) of every prompt in PROMPTS, greedy, ignoring EOS."""
    from kvmesh.engine.sampling_params import SamplingParams
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return [(f"q{i}", p, params) for i, p in enumerate(PROMPTS)]


def _llama():
    from transformers import LlamaConfig, LlamaForCausalLM
    return LlamaForCausalLM(LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        bos_token_id=1, eos_token_id=2))


def _qwen3():
    from transformers import Qwen3Config, Qwen3ForCausalLM
    return Qwen3ForCausalLM(Qwen3Config(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
        tie_word_embeddings=True, bos_token_id=1, eos_token_id=2))


FAMILIES = {"llama": _llama, "qwen3": _qwen3}


def _build(name: str, root) -> tuple[str, object]:
    from kvmesh.engine.loader import load_model
    torch.manual_seed(0)
    path = save_tiny_model(FAMILIES[name]().eval(), root / f"tiny-{name}", seed=5)
    return str(path), load_model(str(path), dtype="float32", device="cpu")


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory):
    """(model directory, LoadedModel) of the tiny Llama."""
    return _build("llama", tmp_path_factory.mktemp("spec-models"))


@pytest.fixture(scope="session", params=sorted(FAMILIES))
def tiny_family(request, tmp_path_factory, tiny_llama):
    if request.param == "llama":
        return "llama", *tiny_llama
    return request.param, *_build(request.param, tmp_path_factory.mktemp("spec-models"))


@dataclass
class Run:
    outputs: dict[str, list]                        # request id -> final CompletionOutputs
    deltas: dict[str, list[list[int]]] = field(default_factory=dict)   # per request, per step
    drafts: int = 0
    draft_tokens: int = 0
    accepted: int = 0
    recompute: int = 0
    swap: int = 0
    cached: int = 0


def run_engine(engine, requests) -> Run:
    """Add (id, prompt, params) requests, step to completion, check the KV cache is whole."""
    for rid, prompt, params in requests:
        engine.add_request(rid, prompt, params)
    run = Run({})
    while engine.has_unfinished_requests():
        for out in engine.step():
            run.deltas.setdefault(out.request_id, []).append(
                [len(c.delta_token_ids) for c in out.outputs])
            if out.finished:
                run.outputs[out.request_id] = out.outputs
                run.cached += out.num_cached_tokens
        s = engine.last_stats
        run.drafts += s.spec_num_drafts
        run.draft_tokens += s.spec_num_draft_tokens
        run.accepted += s.spec_num_accepted_tokens
        run.recompute += s.num_preempted_recompute
        run.swap += s.num_preempted_swap
        engine.kv_manager.check_invariants(engine.scheduler.requests.keys())
    engine.kv_manager.check_invariants([])
    return run


# JSON pieces, one token each, so a tiny model can write JSON (the word-level tokenizer of
# tiny_models cannot: its tokens are w3, w4, ...); the decoder joins them without spaces
JSON_PIECES = list('{}[],:"') + list("0123456789") + list("abcdefghij") + ["true", "false", "null", " "]


def json_ids(text: str) -> list[int]:
    """Token ids of `text`, one character (or keyword) per token, in the tiny JSON vocabulary."""
    ids = {p: 3 + i for i, p in enumerate(JSON_PIECES)}
    return [ids[c] for c in text]


@pytest.fixture(scope="session")
def tiny_json(tmp_path_factory):
    """(model directory, LoadedModel) of a tiny Llama whose tokenizer spells JSON."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    from kvmesh.engine.loader import load_model
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=3 + len(JSON_PIECES), hidden_size=32, intermediate_size=48,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=512, bos_token_id=1, eos_token_id=2))
    path = save_tiny_model(model.eval(), tmp_path_factory.mktemp("spec-models") / "tiny-json",
                           seed=5)
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{p: 3 + i for i, p in enumerate(JSON_PIECES)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.Fuse()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>",
                            eos_token="</s>").save_pretrained(path)
    return str(path), load_model(str(path), dtype="float32", device="cpu")
