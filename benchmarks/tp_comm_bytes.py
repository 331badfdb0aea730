"""Bytes a tensor-parallel step puts on the interconnect, on paper (what NVLink must carry).

    python benchmarks/tp_comm_bytes.py            # the 70B-class shape, TP=2/4/8
    python benchmarks/tp_comm_bytes.py --hidden 1024 --layers 16 --vocab 49152 --dtype-bytes 4

Per step kvmesh runs, per decoder layer, two all-reduces of the [T, hidden] activations (after
o_proj and after down_proj), one more after the vocab-parallel embedding, and one gather of the
sampled rows' logits [R, vocab / N] on rank 0. A ring all-reduce of P bytes sends (and receives)
2 (N - 1) / N * P per rank; the gather brings (N - 1) / N of R * vocab * dtype to rank 0.
"""
from __future__ import annotations

import argparse

MIB = 1 << 20


def step_bytes(tokens: int, rows: int, n: int, hidden: int, layers: int, vocab: int,
               dtype_bytes: int) -> dict[str, float]:
    calls = 2 * layers + 1
    payload = tokens * hidden * dtype_bytes
    per_rank = 2 * (n - 1) / n * payload * calls
    gather = (n - 1) / n * rows * vocab * dtype_bytes
    return {"all_reduces": calls, "payload": payload, "per_rank": per_rank, "gather_to_rank0": gather}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--hidden", type=int, default=8192)
    p.add_argument("--layers", type=int, default=80)
    p.add_argument("--vocab", type=int, default=128256)
    p.add_argument("--dtype-bytes", type=int, default=2, help="2: bfloat16 activations")
    p.add_argument("--link-gbps", type=float, default=450.0, help="GB/s per direction (H100 NVLink 4: 450)")
    a = p.parse_args()
    print(f"# hidden {a.hidden}, {a.layers} layers, vocab {a.vocab}, {a.dtype_bytes}-byte activations")
    print("| step | TP | all-reduces | payload each | sent per rank | logits to rank 0 | at link speed |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name, tokens, rows in (("decode, batch 64", 64, 64), ("prefill chunk, 512 tokens", 512, 1)):
        for n in (2, 4, 8):
            b = step_bytes(tokens, rows, n, a.hidden, a.layers, a.vocab, a.dtype_bytes)
            secs = (b["per_rank"] + b["gather_to_rank0"]) / (a.link_gbps * 1e9)
            print(f"| {name} | {n} | {b['all_reduces']} | {b['payload'] / MIB:.2f} MiB "
                  f"| {b['per_rank'] / MIB:.1f} MiB | {b['gather_to_rank0'] / MIB:.2f} MiB "
                  f"| {secs * 1e3:.2f} ms |")


if __name__ == "__main__":
    main()
