"""GGUF files served as blocks against the same files dequantized to float32: what each holds,
and how far the block kernels move the model's numbers.

    python benchmarks/gguf_files.py FILE.gguf [FILE.gguf ...] [--prompts 3] [--prompt-len 128]

For each file: the count of 2-D tensors per ggml format (the loader serves every format of
kernels/quant/weight.py's FORMATS as blocks; others are dequantized with a warning), the weight
bytes held each way, the mean and max |log-prob difference| of the prompt tokens (vLLM's
prompt_logprobs=0) against the dequantized model, and how many greedy continuations (16 tokens)
are identical. Float activations (the default), chunked prefill below the slabs' row count, as
tests/models/test_gguf_quantized.py checks the built-in file. Files to try: llama.cpp's
`llama-quantize` writes them from the built-in model (`--allow-requantize`; docs/BENCHMARKS.md).
"""
from __future__ import annotations

import argparse
import collections
import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import gguf  # noqa: E402
import torch  # noqa: E402

from benchmarks.offline_throughput import describe_machine  # noqa: E402
from kvmesh.engine.llm import LLM  # noqa: E402
from kvmesh.engine.sampling_params import SamplingParams  # noqa: E402


def formats(path: Path) -> dict[str, int]:
    reader = gguf.GGUFReader(str(path))
    return dict(collections.Counter(t.tensor_type.name for t in reader.tensors if len(t.shape) == 2))


def run(path: Path, quantization: str, prompts: list[list[int]]) -> tuple[int, list, list]:
    # NOTE: a 48-token budget keeps every prefill chunk on the block kernels (below SLAB_MIN_ROWS)
    llm = LLM(str(path), quantization=quantization, dtype="float32", max_num_batched_tokens=48,
              enable_chunked_prefill=True, num_kv_blocks=256, block_size=16, enable_prefix_caching=False)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=16, prompt_logprobs=0, ignore_eos=True)
        outs = llm.generate(prompts, params)
        lps = [torch.tensor([e[t].logprob for e, t in zip(o.prompt_logprobs[1:], p[1:])], dtype=torch.float64)
               for o, p in zip(outs, prompts)]
        return llm.engine.loaded.weight_bytes, lps, [list(o.outputs[0].token_ids) for o in outs]
    finally:
        llm.shutdown()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("files", nargs="+", type=Path)
    p.add_argument("--prompts", type=int, default=3)
    p.add_argument("--prompt-len", type=int, default=128)
    args = p.parse_args()
    print(describe_machine())
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(100, 40000, (args.prompt_len,), generator=g).tolist() for _ in range(args.prompts)]
    print(f"{'file':32s} {'blocks MB':>9s} {'float MB':>9s} {'mean |dlp|':>10s} {'max |dlp|':>9s} "
          f"{'greedy same':>11s}  formats")
    for path in args.files:
        qb, qlp, qtok = run(path, "gguf", prompts)
        db, dlp, dtok = run(path, "none", prompts)
        diff = torch.cat([(a - b).abs() for a, b in zip(qlp, dlp)])
        same = sum(a == b for a, b in zip(qtok, dtok))
        print(f"{path.name:32s} {qb / 1e6:9.1f} {db / 1e6:9.1f} {diff.mean().item():10.2e} "
              f"{diff.max().item():9.2e} {same:>5d} / {len(prompts):<3d}  {formats(path)}", flush=True)


if __name__ == "__main__":
    main()
