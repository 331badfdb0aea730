"""Fixtures for the model / loader / tokenizer tests.

The heavy ones are session-scoped and self-contained (the lead may move them to tests/conftest.py):
our built-in SmolLM2 load, transformers' reference load of the same GGUF (~20 s), and a small
paged-cache generation loop that drives a model the way the engine does (packed batches,
chunked prefill mixed with decodes, random non-contiguous block tables).
"""
from __future__ import annotations

import os
import random
import shutil
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from kvmesh.common.model_files import builtin_model_path, cache_dir  # noqa: E402
from kvmesh.kernels.metadata import AttentionMetadata  # noqa: E402

CHAT_PROMPTS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name three colours."}],
    [{"role": "user", "content": [{"type": "text", "text": "Write a haiku about the sea."}]}],
]



def paged_generate(model, prompts: list[list[int]], max_new_tokens: int, *, block_size: int = 4,
                   prefill_chunk: int = 16, seed: int = 0) -> list[dict]:
    """Greedy generation through the paged KV cache, like the engine's runner.

    Each step packs, for every sequence, either its next prefill chunk or one decode token. Block
    ids are a random permutation, so no sequence owns contiguous blocks. Returns, per prompt,
    {"prompt_logits": [len, V], "gen_logits": [max_new_tokens, V], "tokens": [max_new_tokens]}.
    """
    cfg = model.config
    device = next(model.parameters()).device
    dtype = next(model.parameters()).dtype
    need = [-(-(len(p) + max_new_tokens) // block_size) for p in prompts]
    num_blocks = sum(need) + 3
    ids = list(range(num_blocks))
    random.Random(seed).shuffle(ids)
    tables, start = [], 0
    for n in need:
        tables.append(ids[start:start + n])
        start += n
    shape = (num_blocks, block_size, cfg.num_key_value_heads, cfg.head_dim)
    caches = [(torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
              for _ in range(cfg.num_hidden_layers)]
    done = [0] * len(prompts)                          # tokens already in the cache
    seqs = [list(p) for p in prompts]                  # prompt + generated so far
    out = [{"prompt_logits": [], "gen_logits": [], "tokens": []} for _ in prompts]
    with torch.no_grad():
        while any(len(o["tokens"]) < max_new_tokens for o in out):
            q_lens, s_lens, tok, pos = [], [], [], []
            active = [s for s, o in enumerate(out) if len(o["tokens"]) < max_new_tokens]
            for s in active:
                n = min(prefill_chunk, len(prompts[s]) - done[s]) if done[s] < len(prompts[s]) else 1
                tok += seqs[s][done[s]:done[s] + n]
                pos += range(done[s], done[s] + n)
                q_lens.append(n)
                s_lens.append(done[s] + n)
            meta = AttentionMetadata.build(q_lens, s_lens, [tables[s] for s in active], block_size, device)
            hidden = model(torch.tensor(tok, device=device), torch.tensor(pos, device=device), caches, meta)
            logits = model.compute_logits(hidden).cpu()
            row = 0
            for s, n in zip(active, q_lens):
                rows = logits[row:row + n]
                row += n
                in_prompt = done[s] < len(prompts[s])
                done[s] += n
                if in_prompt:
                    out[s]["prompt_logits"].append(rows)
                if done[s] >= len(prompts[s]):         # the last row predicts the next token
                    nxt = int(rows[-1].argmax())
                    out[s]["gen_logits"].append(rows[-1])
                    out[s]["tokens"].append(nxt)
                    seqs[s].append(nxt)
    for o in out:
        o["prompt_logits"] = torch.cat(o["prompt_logits"])
        o["gen_logits"] = torch.stack(o["gen_logits"])
    return out


def hf_greedy(hf_model, prompt: list[int], max_new_tokens: int) -> tuple[torch.Tensor, list[int], torch.Tensor]:
    """(prompt logits [len, V], greedy tokens, their logits [n, V]) from transformers (its own KV cache)."""
    tokens, gen_logits = [], []
    with torch.no_grad():
        out = hf_model(torch.tensor([prompt]), use_cache=True)
        prompt_logits = out.logits[0].float()
        last = prompt_logits[-1]
        for _ in range(max_new_tokens):
            gen_logits.append(last)
            tokens.append(int(last.argmax()))
            out = hf_model(torch.tensor([[tokens[-1]]]), past_key_values=out.past_key_values, use_cache=True)
            last = out.logits[0, -1].float()
    return prompt_logits, tokens, torch.stack(gen_logits)


def prompt_logprob_diffs(got: list[dict], ref: list[dict], prompts: list[list[int]]) -> torch.Tensor:
    """|log-prob difference| of each prompt's next tokens between two paged_generate results."""
    out = []
    for p, g, r in zip(prompts, got, ref):
        lg = torch.as_tensor(g["prompt_logits"][:-1]).double().log_softmax(-1)
        lr = torch.as_tensor(r["prompt_logits"][:-1]).double().log_softmax(-1)
        nxt = torch.tensor(p[1:])[:, None]
        out.append((lg.gather(1, nxt) - lr.gather(1, nxt)).abs().flatten())
    return torch.cat(out)


def assert_close_to_scale(ours: torch.Tensor, ref: torch.Tensor, rel: float = 1e-4) -> None:
    """|ours - ref| <= rel * max|ref| elementwise (float32 reorderings give ~1e-6 of scale)."""
    scale = float(ref.abs().max().clamp_min(1.0))
    err = float((ours - ref).abs().max())
    assert err <= rel * scale, f"max |diff| {err:.3g} > {rel} x scale {scale:.3g}"


TINY_PROMPTS = [[1, 5, 9, 200, 17, 3, 3, 400], list(range(30, 75))]


def assert_generates_like(model, ref_model, new_tokens: int = 6, prompts: list[list[int]] = TINY_PROMPTS,
                          rel: float = 1e-4) -> float:
    """Both models through paged_generate (blocks of 4, chunks of 8): every prompt logit within
    `rel` of the reference's largest, and the same greedy tokens. Returns the worst |diff| / scale."""
    got = paged_generate(model, prompts, new_tokens, block_size=4, prefill_chunk=8, seed=1)
    ref = paged_generate(ref_model, prompts, new_tokens, block_size=4, prefill_chunk=8, seed=1)
    worst = 0.0
    for g, r in zip(got, ref):
        scale = r["prompt_logits"].abs().max()
        worst = max(worst, float((g["prompt_logits"] - r["prompt_logits"]).abs().max() / scale))
        assert g["tokens"] == r["tokens"]
    assert worst <= rel, f"max |logit diff| {worst:.3g} of scale > {rel}"
    return worst


@pytest.fixture(autouse=True)
def _one_torch_thread():
    """NOTE: on a busy 2-core box, two OpenMP threads spin-wait on each other: the SmolLM2 decode
    loop ran 10x slower with 2 threads than with 1. These tests are many small matmuls."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(name="paged_generate", scope="session")
def _paged_generate_fixture():
    return paged_generate


@pytest.fixture(name="hf_greedy_logits", scope="session")
def _hf_greedy_fixture():
    return hf_greedy


@pytest.fixture(name="assert_close_to_scale", scope="session")
def _assert_close_fixture():
    return assert_close_to_scale


@pytest.fixture(scope="session")
def chat_prompts() -> list[list[dict]]:
    return CHAT_PROMPTS


@pytest.fixture(scope="session")
def builtin_path() -> Path:
    return builtin_model_path()


@pytest.fixture(scope="session")
def smollm_tokenizer_dir(smollm, builtin_path) -> Path:
    """The cached tokenizer.json + tokenizer_config.json converted from the built-in GGUF."""
    from kvmesh.prompt.sources import cache_key

    path = cache_dir() / cache_key(builtin_path)
    assert (path / "tokenizer.json").is_file()
    return path


@pytest.fixture
def copy_tokenizer(smollm_tokenizer_dir):
    """Copy the SmolLM2 tokenizer files into a model directory (tiny random models use it)."""
    def copy(dst: Path) -> None:
        for name in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(smollm_tokenizer_dir / name, dst / name)
    return copy
