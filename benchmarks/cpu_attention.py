"""Decode attention on the CPU: the C++ in-place kernel (`cpu` backend) against the torch reference.

    python benchmarks/cpu_attention.py --seqs 64 --min-ctx 32 --max-ctx 512
    python benchmarks/cpu_attention.py --norm-rope --tokens 64,512
    python benchmarks/cpu_attention.py --dtype bfloat16 --paths amx,avx512_bf16 --seqs 1 --query-len 512 \
        --min-ctx 512 --max-ctx 512       # one 512-token prompt: AMX tiles against the vector kernel

`--paths A,B` times two builds of the kernels (`cpu_kernels.PATHS` names; the first is the native
build when it narrows nothing) on the same step, alternately, and prints the median of the
per-repeat ratios B / A with its quartiles (a noisy machine moves both alike). `--query-len Q`
makes each sequence a prefill chunk of its last Q tokens instead of one decode.

One decode step's attention for every layer of the built-in model's shape (9 query / 3 KV heads
of 64, 30 layers with their own caches), both backends interleaved in one process, best of
--repeats; contexts drawn uniformly (seeded), blocks shuffled through the cache as in a server.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seqs", type=int, default=64)
    p.add_argument("--min-ctx", type=int, default=32)
    p.add_argument("--max-ctx", type=int, default=512)
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--norm-rope", action="store_true",
                   help="time one step's RMSNorms (2 per layer + final, residual fused) and RoPEs instead")
    p.add_argument("--tokens", default="64,512", help="--norm-rope: token counts")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    p.add_argument("--query-len", type=int, default=1, help="query tokens per sequence (the last of its context)")
    p.add_argument("--paths", default="", help="two cpu_kernels.PATHS names: their ratio, interleaved")
    p.add_argument("--kv-cache-dtypes", default="",
                   help="two --kv-cache-dtype values (auto, fp8, fp8_e4m3, fp8_e5m2): the C++ kernel over "
                        "the same K/V stored in each, interleaved, and the ratio")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.norm_rope:
        return norm_rope(args)
    from kvmesh.kernels import cpu_ops, reference
    from kvmesh.kernels.metadata import AttentionMetadata

    heads, kv_heads, dim, block = 9, 3, 64, 16
    dtype = getattr(torch, args.dtype)
    g = torch.Generator().manual_seed(0)
    lens = torch.randint(args.min_ctx, args.max_ctx + 1, (args.seqs,), generator=g).tolist()
    num_blocks = sum(-(-n // block) for n in lens) + 8
    perm = torch.randperm(num_blocks, generator=g).tolist()
    tables = []
    for n in lens:
        tables.append(perm[:-(-n // block)])
        perm = perm[-(-n // block):]
    query_lens = [min(args.query_len, n) for n in lens]
    meta = AttentionMetadata.build(query_lens, lens, tables, block)
    caches = [(torch.randn(num_blocks, block, kv_heads, dim, generator=g).to(dtype),
               torch.randn(num_blocks, block, kv_heads, dim, generator=g).to(dtype)) for _ in range(args.layers)]
    q = torch.randn(sum(query_lens), heads, dim, generator=g).to(dtype)
    head = (f"# {args.seqs} sequences x {args.query_len} query tokens, contexts {args.min_ctx}-{args.max_ctx} "
            f"(mean {sum(lens) / len(lens):.0f}), {args.layers} layers, {args.dtype}, "
            f"{torch.get_num_threads()} threads, load average {os.getloadavg()[0]:.2f}")
    if args.paths:
        return compare_paths(args, head, q, caches, meta)
    if args.kv_cache_dtypes:
        return compare_cache_dtypes(args, head, q, caches, meta)

    def step(ops):
        for k, v in caches:
            ops.paged_attention(q, k, v, meta, dim ** -0.5)

    best = {"reference": float("inf"), "cpu": float("inf")}
    for _ in range(args.repeats):
        for name, ops in (("reference", reference), ("cpu", cpu_ops)):
            t0 = time.perf_counter()
            step(ops)
            best[name] = min(best[name], time.perf_counter() - t0)
    err = (cpu_ops.paged_attention(q, *caches[0], meta, 0.125).float()
           - reference.paged_attention(q, *caches[0], meta, 0.125).float()).abs().max().item()
    print(head)
    print(f"reference {1000 * best['reference']:.1f} ms, cpu kernel {1000 * best['cpu']:.1f} ms per step: "
          f"{best['reference'] / best['cpu']:.2f}x; max abs difference {err:.2e}")


def compare_paths(args, head, q, caches, meta) -> None:
    from kvmesh.kernels import cpu_kernels, cpu_ops

    names = args.paths.split(",")
    if len(names) != 2 or any(n not in cpu_kernels.PATHS for n in names):
        raise SystemExit(f"--paths: two of {', '.join(cpu_kernels.PATHS)}")
    exts = []
    for n in names:
        missing = cpu_kernels.missing_flags(n)
        if missing:
            raise SystemExit(f"the {n} path needs {', '.join(missing)}, which this CPU lacks")
        exts.append(cpu_kernels.load(n) if cpu_kernels.PATHS[n][0] else cpu_kernels.load())
    scale = q.shape[2] ** -0.5

    def step(ext):
        cpu_ops.load = lambda: ext   # noqa: E731 - this process only
        for k, v in caches:
            cpu_ops.paged_attention(q, k, v, meta, scale)

    times = alternate(args.repeats, [lambda ext=ext: step(ext) for ext in exts])
    report(head, names, times)


def alternate(repeats: int, steps) -> list[list[float]]:
    """Seconds of each of `steps` (callables), run in turn `repeats` times."""
    times: list[list[float]] = [[] for _ in steps]
    for _ in range(repeats):
        for i, step in enumerate(steps):
            t0 = time.perf_counter()
            step()
            times[i].append(time.perf_counter() - t0)
    return times


def report(head: str, labels: list[str], times: list[list[float]]) -> None:
    """Best and median of two alternated variants, and the median of the per-repeat ratios."""
    ratios = sorted(b / a for a, b in zip(*times))
    n = len(ratios)
    print(head)
    for label, t in zip(labels, times):
        print(f"{label}: best {1000 * min(t):.1f} ms, median {1000 * sorted(t)[len(t) // 2]:.1f} ms per step")
    first, second = (label.split(" ")[0] for label in labels)
    print(f"{second} / {first} time: median {ratios[n // 2]:.2f}x (quartiles {ratios[n // 4]:.2f}x, "
          f"{ratios[3 * n // 4]:.2f}x) over {n} alternating repeats")


def compare_cache_dtypes(args, head, q, caches, meta) -> None:
    from kvmesh.kernels import cpu_ops
    from kvmesh.kernels.kv_cache_dtype import resolve_kv_cache_dtype, to_cache_codes

    names = args.kv_cache_dtypes.split(",")
    if len(names) != 2:
        raise SystemExit("--kv-cache-dtypes: two values, e.g. auto,fp8")
    stores = []
    for n in names:
        dt = resolve_kv_cache_dtype(n, q.dtype, "cpu")
        stores.append([(to_cache_codes(k, dt), to_cache_codes(v, dt)) for k, v in caches])
    scale = q.shape[2] ** -0.5

    def step(store):
        for k, v in store:
            cpu_ops.paged_attention(q, k, v, meta, scale)

    times = alternate(args.repeats, [lambda store=store: step(store) for store in stores])
    labels = [f"{n} ({store[0][0].dtype}, {sum(k.nbytes + v.nbytes for k, v in store) / 1e6:.0f} MB of K/V)"
              for n, store in zip(names, stores)]
    report(head, labels, times)


def norm_rope(args) -> None:
    from kvmesh.kernels import cpu_ops, reference

    g = torch.Generator().manual_seed(0)
    table = torch.randn(8192, 64, generator=g)
    print(f"# {args.layers} layers, hidden 576, 9 / 3 heads of 64, {torch.get_num_threads()} threads, "
          f"load average {os.getloadavg()[0]:.2f}")
    for tokens in (int(t) for t in args.tokens.split(",")):
        x, r = torch.randn(tokens, 576, generator=g), torch.randn(tokens, 576, generator=g)
        w = torch.randn(576, generator=g)
        qkv = torch.randn(tokens, 960, generator=g)
        q, k = qkv[:, :576].view(tokens, 9, 64), qkv[:, 576:768].view(tokens, 3, 64)
        pos = torch.randint(0, 8192, (tokens,), generator=g)

        def step(ops):
            for _ in range(args.layers):
                ops.rms_norm(x, w, 1e-5, r)
                ops.rms_norm(x, w, 1e-5, r)
                ops.rotary_embedding(pos, q, k, table)

        best = {"reference": float("inf"), "cpu": float("inf")}
        for _ in range(args.repeats):
            for name, ops in (("reference", reference), ("cpu", cpu_ops)):
                t0 = time.perf_counter()
                step(ops)
                best[name] = min(best[name], time.perf_counter() - t0)
        print(f"{tokens} tokens: reference {1000 * best['reference']:.2f} ms, cpu kernels "
              f"{1000 * best['cpu']:.2f} ms per step: {best['reference'] / best['cpu']:.2f}x")


if __name__ == "__main__":
    main()
