"""Prefill attention: the engine's paths against torch's SDPA flash kernel, in TFLOP/s.

    python benchmarks/prefill_attention.py --device cuda          # 1x8192, 8x2048, 32x512, bf16
    python benchmarks/prefill_attention.py --device cuda --shapes 4x4096 --prefix 4096
    python benchmarks/prefill_attention.py --device cpu           # smoke: interpreter, tiny shapes

For each shape BxL (B prompts of L tokens; heads 32/8, head_dim 128: Llama-8B's attention) it
times, on the same K/V:
  * sdpa: `scaled_dot_product_attention(is_causal=True)` on [B, H, L, D] (flash backend), the
    target (issue 30: the engine's prefill attention >= 0.9x its speed);
  * varlen: `torch.nn.attention.varlen.varlen_attn` on the packed chunks;
  * route-varlen / route-sdpa: the engine's path for chunks with no cached prefix
    (`kernels/flash_prefill.py`: K/V gathered back from the paged cache, then flash);
  * unified: the Triton unified kernel over the paged cache (the path of chunks after a
    cached prefix and of mixed steps), with this GPU's default tiles;
and prints ms, TFLOP/s (causal: 2 * 2 * B * H * L^2 * D / 2 FLOPs) and the ratio to sdpa. With
`--prefix P` every prompt follows a cached prefix of P tokens: only unified applies (flash
rows are skipped) and sdpa runs with the equivalent bottom-right causal mask. Every path's
output is compared with sdpa's (max abs error). On `--device cpu` the Triton kernels run in
the interpreter at tiny shapes: a check that the script runs, not a measurement.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

_DTYPES = ("bf16", "fp16")


def _parse(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--shapes", nargs="+", default=None,
                   help="BxL, e.g. 1x8192 8x2048 (default: 1x8192 8x2048 32x512; cpu: 2x48)")
    p.add_argument("--prefix", type=int, default=0, help="cached prefix before each prompt")
    p.add_argument("--num-heads", type=int, default=32)
    p.add_argument("--num-kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--dtype", choices=_DTYPES, default="bf16")
    p.add_argument("--block-m", type=int, default=None, help="unified kernel tiles (default: per arch)")
    p.add_argument("--block-n", type=int, default=None)
    p.add_argument("--num-warps", type=int, default=None)
    p.add_argument("--num-stages", type=int, default=None)
    return p.parse_args(argv)


def _bench(fn, device: str) -> float:
    """Milliseconds per call (triton's do_bench on CUDA; one timed call on CPU)."""
    if device == "cuda":
        from triton.testing import do_bench
        return do_bench(fn)
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


def _case(args, batch: int, length: int, torch, dtype):
    """Paged cache holding each prompt's prefix + prompt; q of the prompts packed."""
    h, kvh, d, bs, dev = args.num_heads, args.num_kv_heads, args.head_dim, args.block_size, args.device
    ctx = args.prefix + length
    per_seq = -(-ctx // bs)
    num_blocks = batch * per_seq
    gen = torch.Generator(device=dev).manual_seed(0)
    k_cache = torch.randn(num_blocks, bs, kvh, d, generator=gen, device=dev).to(dtype)
    v_cache = torch.randn(num_blocks, bs, kvh, d, generator=gen, device=dev).to(dtype)
    tables = torch.randperm(num_blocks, generator=gen, device=dev).to(torch.int32).view(batch, per_seq)
    q = torch.randn(batch * length, h, d, generator=gen, device=dev).to(dtype)
    from kvmesh.kernels.metadata import AttentionMetadata
    meta = AttentionMetadata.build([length] * batch, [ctx] * batch, tables.tolist(), bs, device=dev)
    return q, k_cache, v_cache, meta


def _dense(k_cache, meta, batch, ctx):
    """[B, KVH, ctx, D] K or V gathered from the paged cache."""
    t = k_cache[meta.block_tables.long()].flatten(1, 2)[:, :ctx]      # [B, ctx, KVH, D]
    return t.transpose(1, 2).contiguous()


def main(argv=None) -> int:
    args = _parse(argv)
    if args.device == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")   # before any kernel module is imported
    import torch
    import torch.nn.functional as F

    if args.device == "cuda" and not torch.cuda.is_available():
        print("--device cuda needs a CUDA GPU (torch.cuda.is_available() is False); "
              "--device cpu runs the smoke check", file=sys.stderr)
        return 2
    if args.num_heads % args.num_kv_heads:
        print("--num-heads must be a multiple of --num-kv-heads", file=sys.stderr)
        return 2
    from kvmesh.kernels import flash_prefill
    from kvmesh.kernels.prefill_attention import default_tiles, device_arch, unified_attention

    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float16
    if args.device == "cpu":
        dtype = torch.float16        # NOTE: the interpreter cannot do bf16 arithmetic
        args.num_heads, args.num_kv_heads, args.head_dim = 4, 2, 32
    shapes = args.shapes or (["1x8192", "8x2048", "32x512"] if args.device == "cuda" else ["2x48"])
    h, kvh, d = args.num_heads, args.num_kv_heads, args.head_dim
    arch = device_arch(torch.device(args.device))
    tiles = default_tiles(dtype, 1 << (h // kvh - 1).bit_length(), d, arch)
    if args.device == "cuda":
        import triton
        print(f"# {torch.cuda.get_device_name()} (sm_{arch})  torch {torch.__version__}  triton {triton.__version__}")
    print(f"# {args.dtype if args.device == 'cuda' else 'fp16'}, heads {h}/{kvh}, head_dim {d}, "
          f"block_size {args.block_size}, prefix {args.prefix}; unified tiles (block_m, block_n, "
          f"warps, stages) default {tiles}")
    head = f"{'shape':>8} {'path':>13} {'ms':>9} {'TFLOP/s':>8} {'x sdpa t':>9} {'max err':>8}"
    print(head)
    print("-" * len(head))
    scale = d ** -0.5
    for shape in shapes:
        batch, length = (int(x) for x in shape.lower().split("x"))
        ctx = args.prefix + length
        q, kc, vc, meta = _case(args, batch, length, torch, dtype)
        # causal FLOPs of QK^T and PV: each query row sees prefix + its position + 1 keys
        flops = 4 * batch * h * d * (length * args.prefix + length * (length + 1) / 2)
        kd, vd = _dense(kc, meta, batch, ctx), _dense(vc, meta, batch, ctx)
        qd = q.view(batch, length, h, d).transpose(1, 2)
        if args.prefix:
            # bottom-right causal: query i sees positions <= prefix + i
            mask = torch.ones(length, ctx, dtype=torch.bool, device=args.device).tril(args.prefix)
            sdpa = lambda: F.scaled_dot_product_attention(qd, kd, vd, attn_mask=mask, scale=scale,  # noqa: E731
                                                          enable_gqa=True)
        else:
            sdpa = lambda: F.scaled_dot_product_attention(qd, kd, vd, is_causal=True, scale=scale,  # noqa: E731
                                                          enable_gqa=True)
        ref = sdpa().transpose(1, 2).reshape(batch * length, h, d)
        paths = {"sdpa": sdpa}
        if not args.prefix:
            if args.device == "cuda":
                from torch.nn.attention.varlen import varlen_attn
                kp = kd.transpose(1, 2).reshape(batch * ctx, kvh, d)
                vp = vd.transpose(1, 2).reshape(batch * ctx, kvh, d)
                paths["varlen"] = lambda: varlen_attn(q, kp, vp, meta.query_start_loc,  # noqa: E731
                                                      meta.query_start_loc, length, length,
                                                      scale=scale, window_size=(-1, 0),
                                                      enable_gqa=True)
            impls = ("varlen", "sdpa") if args.device == "cuda" else ("sdpa",)
            for impl in impls:
                paths[f"route-{impl}"] = (lambda impl=impl: flash_prefill.prefill_attention(
                    q, kc, vc, meta, scale, 0.0, unified_attention, impl))
        paths["unified"] = lambda: unified_attention(  # noqa: E731
            q, kc, vc, meta.query_start_loc, meta.seq_lens, meta.block_tables, scale,
            block_m=args.block_m, block_n=args.block_n, num_warps=args.num_warps,
            num_stages=args.num_stages)
        sdpa_ms = None
        for name, fn in paths.items():
            out = fn()
            out = out.transpose(1, 2).reshape(batch * length, h, d) if name == "sdpa" else out
            err = (out.float() - ref.float()).abs().max().item()
            ms = _bench(fn, args.device)
            sdpa_ms = sdpa_ms or ms
            print(f"{shape:>8} {name:>13} {ms:>9.3f} {flops / (ms * 1e-3) / 1e12:>8.1f} "
                  f"{ms / sdpa_ms:>9.2f} {err:>8.1e}")
        del q, kc, vc, kd, vd, qd, ref
        if args.device == "cuda":
            torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
