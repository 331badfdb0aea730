"""GPU benchmark of the paged decode kernel: bandwidth vs a device copy, time vs contiguous SDPA.

    python benchmarks/paged_decode_kernel.py   # the issue's grid, bf16, head_dim 128, GQA 8:1
    python benchmarks/paged_decode_kernel.py --batches 16 64 --contexts 2048 8192 --block-size 32
    python benchmarks/paged_decode_kernel.py --batches 1 4 16 --contexts 128 512 1024 --max-model-len 8192
        # small batches at short context, the split count fixed as a CUDA graph fixes it
    python benchmarks/paged_decode_kernel.py --kv-cache-dtypes auto fp8_e4m3 fp8_e5m2
        # the same kernel over --kv-cache-dtype fp8 caches: a row per cache dtype

For each (batch, context) it prints one row:
  * the split count (the engine's rule, kernels/decode_plan.py; splits of at least
    --min-split-tokens, so a short context uses one: one launch, output written directly);
  * the decode kernel's time and achieved bandwidth (K/V bytes read + q/out) as a fraction of the
    measured device-to-device copy bandwidth (read + write bytes of a large `copy_`), once per
    cache dtype of --kv-cache-dtypes (`auto`: the query's dtype; fp8_*: 8-bit codes, half the
    bytes, widened in registers; with --fp8-bit-path also as bytes widened by bit operations,
    the sm_80 / interpreter path, `fp8_codes.kv_read`), and the time against the first row's;
  * the time of torch's scaled_dot_product_attention on the same K/V laid out contiguously,
    [batch, kv_heads, context, head_dim], with the GQA group folded into the query length
    (q [batch, kv_heads, group, head_dim]), which is exact for decode and lets SDPA pick its
    flash kernel; and the ratio paged / SDPA.
Targets (issue 7): >= 70% of copy bandwidth at context >= 2k and batch >= 16; <= 1.25x SDPA
(issue 30: batch 1-16 at short context no slower than SDPA).
Configurations that do not fit in free GPU memory are skipped. Needs CUDA; not run by pytest.
"""
from __future__ import annotations

import argparse
import sys

import torch
import torch.nn.functional as F

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64, 256])
    p.add_argument("--contexts", type=int, nargs="+", default=[512, 2048, 8192, 32768])
    p.add_argument("--num-heads", type=int, default=64)
    p.add_argument("--num-kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--dtype", choices=sorted(_DTYPES), default="bf16")
    p.add_argument("--kv-cache-dtypes", nargs="+", default=["auto"],
                   help="the caches' element types, as --kv-cache-dtype names them (auto, fp8, "
                        "fp8_e4m3, fp8_e5m2): each configuration runs once per value")
    p.add_argument("--fp8-bit-path", action="store_true",
                   help="each 8-bit cache also read as bytes widened by bit operations (as on sm_80), "
                        "beside the device's own conversion (sm_89+)")
    p.add_argument("--num-splits", type=int, default=None,
                   help="default: the engine's rule (kernels/decode_plan.py) at the context, or at "
                        "--max-model-len (a CUDA graph's fixed count)")
    p.add_argument("--min-split-tokens", type=int, default=None,
                   help="fewest tokens a split takes (default: the engine's, decode_plan.py)")
    p.add_argument("--max-model-len", type=int, default=None,
                   help="fix the split count as a CUDA graph of this batch size does (the rule at "
                        "this length), whatever the context: the graph case at short context")
    p.add_argument("--block-n", type=int, default=None, help="context tokens a tile (default: the "
                   "kernel's rule for the cache dtype)")
    p.add_argument("--num-warps", type=int, default=None, help="default: the kernel's rule")
    p.add_argument("--num-stages", type=int, default=2)
    p.add_argument("--copy-gib", type=float, default=2.0, help="size of the copy-bandwidth probe")
    return p.parse_args(argv)


def _copy_bandwidth(do_bench, gib: float) -> float:
    """Bytes/s of a device-to-device copy, counting the read and the write."""
    n = int(gib * 2**30)
    src = torch.empty(n, dtype=torch.uint8, device="cuda").random_(0, 255)
    dst = torch.empty_like(src)
    ms = do_bench(lambda: dst.copy_(src))
    del src, dst
    torch.cuda.empty_cache()
    return 2 * n / (ms * 1e-3)


def _fits(nbytes: int) -> bool:
    free, _ = torch.cuda.mem_get_info()
    return nbytes < 0.9 * free


def _bench_paged(args, do_bench, batch: int, ctx: int, dtype: torch.dtype, cache_dtype: torch.dtype,
                 arch: int | None):
    from kvmesh.kernels.decode_plan import DEFAULT_MIN_SPLIT_TOKENS, DecodeWorkspace
    from kvmesh.kernels.paged_attention import default_num_splits, paged_decode_attention

    kvh, d, bs = args.num_kv_heads, args.head_dim, args.block_size
    blocks_per_seq = -(-ctx // bs)
    num_blocks = batch * blocks_per_seq
    k_cache = torch.empty(num_blocks, bs, kvh, d, dtype=dtype, device="cuda").normal_().to(cache_dtype)
    v_cache = torch.empty(num_blocks, bs, kvh, d, dtype=dtype, device="cuda").normal_().to(cache_dtype)
    # NOTE: a random permutation: no two neighbouring blocks of a sequence are adjacent in memory
    tables = torch.randperm(num_blocks, device="cuda").to(torch.int32).view(batch, blocks_per_seq)
    seq_lens = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
    query = torch.randn(batch, args.num_heads, d, dtype=dtype, device="cuda")
    scale = d ** -0.5
    min_tokens = args.min_split_tokens or DEFAULT_MIN_SPLIT_TOKENS
    splits = args.num_splits or default_num_splits(batch, kvh, args.max_model_len or ctx,
                                                   query.device, min_split_tokens=min_tokens)
    # NOTE: preallocated once, as the engine's DecodePlanner does (no allocation per call)
    workspace = DecodeWorkspace.allocate(batch * splits, args.num_heads, d, "cuda")

    def run():
        return paged_decode_attention(query, k_cache, v_cache, tables, seq_lens, ctx, scale,
                                      num_splits=splits, min_split_tokens=min_tokens,
                                      workspace=workspace, block_n=args.block_n,
                                      num_warps=args.num_warps, num_stages=args.num_stages, arch=arch)

    out = run()
    # spot check of sequence 0 against SDPA on its gathered context (codes widened to the query's dtype)
    k0 = k_cache[tables[0].long()].flatten(0, 1)[:ctx].transpose(0, 1)[None].to(dtype)  # [1, kvh, ctx, d]
    v0 = v_cache[tables[0].long()].flatten(0, 1)[:ctx].transpose(0, 1)[None].to(dtype)
    q0 = query[0].view(1, kvh, -1, d)
    ref0 = F.scaled_dot_product_attention(q0, k0, v0, scale=scale).reshape(-1, d)
    err = (out[0].float() - ref0.float()).abs().max().item()
    ms = do_bench(run)
    # bytes the kernel must move: every context token's K and V, the queries in, the output out
    nbytes = (2 * batch * ctx * kvh * d * k_cache.element_size()
              + 2 * query.numel() * query.element_size() + tables.numel() * 4)
    del k_cache, v_cache, tables, out, k0, v0
    torch.cuda.empty_cache()
    return ms, nbytes, splits, err


def _bench_sdpa(args, do_bench, batch: int, ctx: int, dtype: torch.dtype) -> float:
    kvh, d = args.num_kv_heads, args.head_dim
    k = torch.empty(batch, kvh, ctx, d, dtype=dtype, device="cuda").normal_()
    v = torch.empty_like(k).normal_()
    q = torch.randn(batch, kvh, args.num_heads // kvh, d, dtype=dtype, device="cuda")
    ms = do_bench(lambda: F.scaled_dot_product_attention(q, k, v, scale=d ** -0.5))
    del k, v, q
    torch.cuda.empty_cache()
    return ms


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    if not torch.cuda.is_available():
        print("benchmarks/paged_decode_kernel.py needs a CUDA GPU (torch.cuda.is_available() is "
              "False): run it on a GPU machine. The CPU test suite checks correctness only "
              "(TRITON_INTERPRET=1).",
              file=sys.stderr)
        return 2
    import triton
    from triton.testing import do_bench

    if args.num_heads % args.num_kv_heads:
        print("--num-heads must be a multiple of --num-kv-heads", file=sys.stderr)
        return 2
    dtype = _DTYPES[args.dtype]
    from kvmesh.kernels.kv_cache_dtype import is_fp8, resolve_kv_cache_dtype
    try:
        cache_dtypes = [resolve_kv_cache_dtype(n, dtype, "triton") for n in args.kv_cache_dtypes]
    except ValueError as e:
        print(f"--kv-cache-dtypes: {e}", file=sys.stderr)
        return 2
    copy_bw = _copy_bandwidth(do_bench, args.copy_gib)
    print(f"# {torch.cuda.get_device_name()}  torch {torch.__version__}  triton {triton.__version__}")
    print(f"# {args.dtype}, heads {args.num_heads}/{args.num_kv_heads} (GQA "
          f"{args.num_heads // args.num_kv_heads}:1), head_dim {args.head_dim}, "
          f"block_size {args.block_size}, block_n {args.block_n or 'default'}, warps {args.num_warps or 'default'}")
    print(f"# device-to-device copy bandwidth: {copy_bw / 1e9:.0f} GB/s")
    head = (f"{'batch':>5} {'ctx':>6} {'cache':>9} {'splits':>6} {'paged us':>9} {'GB/s':>7} {'% copy':>7} "
            f"{'sdpa us':>9} {'x sdpa':>7} {'x first':>7} {'max err':>8}  targets")
    print(head)
    print("-" * len(head))
    for batch in args.batches:
        for ctx in args.contexts:
            kv_bytes = 2 * batch * ctx * args.num_kv_heads * args.head_dim * dtype.itemsize
            if not _fits(kv_bytes):
                print(f"{batch:>5} {ctx:>6}  skipped: {kv_bytes / 2**30:.1f} GiB of K/V "
                      f"does not fit in free memory")
                continue
            sdpa_ms = _bench_sdpa(args, do_bench, batch, ctx, dtype)
            first_ms = None
            rows = []      # (name, cache dtype, arch the kernel reads it for: None, the device's)
            for name, cache_dtype in zip(args.kv_cache_dtypes, cache_dtypes):
                rows.append((name, cache_dtype, None))
                if args.fp8_bit_path and is_fp8(cache_dtype):
                    rows.append((name.removeprefix("fp8_") + "/bits", cache_dtype, 80))
            for name, cache_dtype, arch in rows:
                ms, nbytes, splits, err = _bench_paged(args, do_bench, batch, ctx, dtype, cache_dtype, arch)
                first_ms = first_ms or ms
                bw = nbytes / (ms * 1e-3)
                frac, ratio = bw / copy_bw, ms / sdpa_ms
                notes = []
                if ctx >= 2048 and batch >= 16:
                    notes.append("bw ok" if frac >= 0.70 else "BW BELOW 70%")
                notes.append("sdpa ok" if ratio <= 1.25 else "SLOWER THAN 1.25x SDPA")
                print(f"{batch:>5} {ctx:>6} {name:>9} {splits:>6} {ms * 1e3:>9.1f} {bw / 1e9:>7.0f} "
                      f"{100 * frac:>6.1f}% {sdpa_ms * 1e3:>9.1f} {ratio:>7.2f} {ms / first_ms:>7.2f} "
                      f"{err:>8.1e}  {', '.join(notes)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
