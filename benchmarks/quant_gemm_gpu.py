"""The Triton quantized GEMMs (kernels/quant/triton_gemm.py) against torch's dense GEMM on a GPU.

    python benchmarks/quant_gemm_gpu.py                       # Llama-8B shapes, M 1..4096, bf16
    python benchmarks/quant_gemm_gpu.py --shapes gate_up,down --rows 1,16,256 --dtype fp16
    python benchmarks/quant_gemm_gpu.py --device cpu          # smoke: interpreter, tiny shapes

For each projection shape (N x K; Llama-3-8B's, q/k/v and gate/up fused as the engine runs them)
and each M, on random weights of that shape, it times with triton's do_bench (median ms):
  * dense:   torch.nn.functional.linear on the bf16/fp16 weight (cuBLAS), the reference speed;
  * w4a16:   w4a16_gemm's fused kernel, int4 groups of 128 with zero points (0.5 bytes a weight
             + 1/64 of scales);
  * w4a16-dequant: its other route, the weight dequantized into a buffer, then cuBLAS;
  * w4a16-gemv: its decode route (up to 16 rows): no tensor-core tile, float32 FMAs over wide
             contiguous weight runs (`_gemv_tiles`' tiles);
  * w8a8:    w8a8_gemm, int8 weights per channel, x quantized per token (the quantization
             kernel included in the time);
  * fp8:     fp8_gemm, e4m3 weights per channel (sm_89+: x cast per tensor, fp8 MMA, its
             max-reduction and cast included; below: the weight widened in registers);
  * fp8-token: the same with x cast per token (compressed-tensors' FP8_DYNAMIC);
  * scaled_mm: torch._scaled_mm on the same fp8 operands (sm_89+ only; x quantized by torch
             outside the timing), the peer for the fp8 path;
  * w8g, w8g-gemv, w8g-dequant (not in the default --paths): kernels/quant/triton_w8g.py's
             fused kernel, GEMV and dequantize-then-cuBLAS routes on GGUF's 8-bit groups, in
             Q8_0's layout (one code a byte, fp16 scale and uint8 zero per 32: 1.09 bytes a
             weight), the numbers its W8G_GEMV_MAX_ROWS / W8G_DEQUANT_MIN_ROWS wait for;
`--cudagraph` times each call replayed from a CUDA graph (triton's do_bench_cudagraph), as the
engine runs its decode steps: at a few rows a kernel's time is then its own, not the launch's.
`--gemv-sweep` times the GEMV kernel over a grid of (BLOCK_N, BLOCK_K, num_warps) for each
shape and M <= 16 and prints the best against the default tiles and dense bf16.

It prints per row the time in microseconds, the ratio dense / path (above 1: faster than
dense), the weight bytes a call reads and the bandwidth that makes (weight bytes / time), and
each path's largest error against its torch reference (kernels/reference.py), relative to
max |reference|. On `--device cpu` the kernels run in the interpreter at tiny shapes: a check
that the script runs, not a measurement.
"""
from __future__ import annotations

import argparse
import os
import re
import sys
import time

# Llama-3-8B: hidden 4096, 32 query / 8 KV heads of 128, MLP 14336; fused as the engine runs them
SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
CPU_SHAPES = {"tiny": (40, 128)}
DEFAULT_PATHS = ("dense", "w4a16", "w4a16-dequant", "w4a16-gemv", "w8a8", "fp8", "fp8-token", "scaled_mm")
PATHS = DEFAULT_PATHS + ("w8g", "w8g-gemv", "w8g-dequant")
SWEEP = [(bn, 128, w, st) for bn in (2, 4, 8, 16, 32) for w in (1, 2, 4) for st in (1, 3)]
GROUP_SIZE = 128
W8G_GROUP = 32          # GGUF Q8_0 / Q5_0 / IQ4_NL's groups (triton_w8g)


def _parse(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--shapes", default=None, help=f"comma-separated, of {', '.join(SHAPES)} (default: all)")
    p.add_argument("--rows", default=None, help="comma-separated M (default: 1,16,64,256,1024,4096; cpu: 1,20)")
    p.add_argument("--dtype", choices=("bf16", "fp16"), default="bf16")
    p.add_argument("--paths", default=",".join(DEFAULT_PATHS), help=f"comma-separated, of {', '.join(PATHS)}, "
                   "and w4a16-kN: the fused kernel with K split N ways")
    p.add_argument("--cudagraph", action="store_true", help="time calls replayed from a CUDA graph")
    p.add_argument("--gemv-sweep", action="store_true", help="sweep the GEMV kernel's tiles instead")
    return p.parse_args(argv)


def _bench(fn, device: str, graph: bool = False) -> float:
    """Milliseconds per call (do_bench's median on CUDA, or do_bench_cudagraph's mean of graph
    replays; one timed call on CPU)."""
    if device == "cuda":
        from triton.testing import do_bench, do_bench_cudagraph
        if graph:
            fn()                                     # compile outside the capture
            return do_bench_cudagraph(fn, rep=50)
        return do_bench(fn, return_mode="median")
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


def _weights(torch, n: int, k: int, dtype, device: str, g):
    """Every layout of one random [n, k] weight: (dense, int4 groups, int8, e4m3) and their bytes."""
    from kvmesh.kernels import reference
    qweight = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, device=device, generator=g)
    scales = (torch.rand(n, k // GROUP_SIZE, device=device, generator=g) * 2e-3 + 1e-4).to(dtype)
    zeros = torch.randint(0, 16, (n, k // GROUP_SIZE), dtype=torch.uint8, device=device, generator=g)
    dense = reference.dequantize_int4(qweight, scales, zeros, GROUP_SIZE).to(dtype)
    w8 = torch.randint(-127, 128, (n, k), dtype=torch.int8, device=device, generator=g)
    w8_scale = torch.rand(n, device=device, generator=g) * 1e-4 + 1e-5
    fp8 = (torch.randn(n, k, device=device, generator=g) * 20).to(torch.float8_e4m3fn)
    fp8_scale = torch.rand(n, device=device, generator=g) * 1e-3 + 1e-5
    w8g = (torch.randint(0, 256, (n, k), dtype=torch.uint8, device=device, generator=g),
           (torch.rand(n, k // W8G_GROUP, device=device, generator=g) * 1e-4 + 1e-5).half(),
           torch.full((n, k // W8G_GROUP), 128, dtype=torch.uint8, device=device))
    int4_bytes = qweight.numel() + zeros.numel() + scales.numel() * scales.element_size()
    w8g_bytes = sum(t.numel() * t.element_size() for t in w8g)
    fp8_bytes = fp8.numel() + 4 * n
    nbytes = {"dense": dense.numel() * dense.element_size(), "w4a16": int4_bytes, "w4a16-dequant": int4_bytes,
              "w4a16-gemv": int4_bytes,
              "w8a8": w8.numel() + 4 * n, "fp8": fp8_bytes, "fp8-token": fp8_bytes, "scaled_mm": fp8_bytes,
              "w8g": w8g_bytes, "w8g-gemv": w8g_bytes, "w8g-dequant": w8g_bytes}
    return dict(dense=dense, int4=(qweight, scales, zeros), w8=(w8, w8_scale), fp8=(fp8, fp8_scale), w8g=w8g), nbytes


def _calls(torch, w, x, fp8_mma: bool, splits: tuple[int, ...] = ()):
    """path -> (the timed call, its float64 reference or None)."""
    import torch.nn.functional as F

    from kvmesh.kernels import reference
    from kvmesh.kernels.quant import triton_gemm as tg
    from kvmesh.kernels.quant import triton_w8g
    calls = {
        "dense": (lambda: F.linear(x, w["dense"]), lambda: x.double() @ w["dense"].double().T),
        "w4a16": (lambda: tg.w4a16_gemm(x, *w["int4"], GROUP_SIZE, route="kernel"),  # its split-K choice
                  lambda: reference.w4a16_gemm(x, *w["int4"], GROUP_SIZE)),
        "w4a16-dequant": (lambda: tg.w4a16_gemm(x, *w["int4"], GROUP_SIZE, route="dequant"),
                          lambda: reference.w4a16_gemm(x, *w["int4"], GROUP_SIZE)),
        "w4a16-gemv": (lambda: tg.w4a16_gemm(x, *w["int4"], GROUP_SIZE, route="gemv"),
                       lambda: reference.w4a16_gemm(x, *w["int4"], GROUP_SIZE)),
        "w8a8": (lambda: tg.w8a8_gemm(x, *w["w8"]), lambda: reference.w8a8_gemm(x, *w["w8"])),
        "fp8": (lambda: tg.fp8_gemm(x, *w["fp8"]),
                lambda: reference.fp8_gemm(x, *w["fp8"], activations="tensor" if fp8_mma else "none")),
        "fp8-token": (lambda: tg.fp8_gemm(x, *w["fp8"], activations="token"),
                      lambda: reference.fp8_gemm(x, *w["fp8"], activations="token" if fp8_mma else "none")),
    }
    for path, route in (("w8g", "kernel"), ("w8g-gemv", "gemv"), ("w8g-dequant", "dequant")):
        if route != "gemv" or x.shape[0] <= tg.GEMV_ROWS_LIMIT:
            calls[path] = (lambda r=route: triton_w8g.w8g_gemm(x, *w["w8g"], W8G_GROUP, route=r),
                           lambda: reference.w8g_gemm(x, *w["w8g"], W8G_GROUP))
    for n in splits:
        calls[f"w4a16-k{n}"] = (
            lambda s=n: tg.w4a16_gemm(x, *w["int4"], GROUP_SIZE, route="kernel", split_k=s),
            lambda: reference.w4a16_gemm(x, *w["int4"], GROUP_SIZE))
    if fp8_mma and x.is_cuda and hasattr(torch, "_scaled_mm"):
        xq, xs = reference.scaled_fp8_quant(x)
        fp8, ws = w["fp8"]
        row_scale = xs.expand(x.shape[0]).reshape(-1, 1).contiguous()     # row-wise a with per-channel b
        calls["scaled_mm"] = (
            lambda: torch._scaled_mm(xq, fp8.T, scale_a=row_scale, scale_b=ws.reshape(1, -1),
                                     out_dtype=x.dtype),
            lambda: reference.fp8_gemm(x, fp8, ws, activations="tensor"))
    return calls


def _sweep(torch, w, x, dense_ms: float, device: str, graph: bool, label: str) -> None:
    """The GEMV kernel over SWEEP's tiles: every tile's time and error, then the best."""
    from kvmesh.kernels import reference
    from kvmesh.kernels.quant import triton_gemm as tg
    want = reference.w4a16_gemm(x, *w["int4"], GROUP_SIZE)
    scale = max(want.abs().max().item(), 1e-30)
    default = tg._gemv_tiles(w["int4"][0].shape[0])
    seen = {}
    rows = 1 << (x.shape[0] - 1).bit_length()
    # NOTE: past 32,768 products a program (256 a thread at 4 warps) the tile only spills
    for tiles in [t for t in SWEEP if rows * t[0] * t[1] // 2 <= 32768]:
        def run(t=tiles):
            return tg.w4a16_gemm(x, *w["int4"], GROUP_SIZE, route="gemv", gemv_tiles=t)
        try:
            err = (run().double() - want).abs().max().item() / scale
            seen[tiles] = (_bench(run, device, graph), err)
        except Exception as e:  # noqa: BLE001  (one tile that fails to compile must not end the sweep)
            print(f"| {label} | {tiles} | failed: {type(e).__name__}: {str(e).strip().splitlines()[0][:120]} |")
    for tiles, (ms, err) in sorted(seen.items(), key=lambda kv: kv[1][0]):
        print(f"| {label} | {tiles} | {ms * 1e3:.1f} | {dense_ms / ms:.2f} | {err:.1e} |"
              f"{' default' if tiles[:3] == default[:3] else ''}")
    if seen:
        best = min(seen, key=lambda t: seen[t][0])
        d = seen.get(default, (float("nan"), 0))[0]
        print(f"# best {label}: {best} {seen[best][0] * 1e3:.1f} us ({dense_ms / seen[best][0]:.2f}x dense "
              f"{dense_ms * 1e3:.1f} us); default {default} {d * 1e3:.1f} us")


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    if args.device == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")     # before any kernel module is imported
    import torch
    if args.device == "cuda" and not torch.cuda.is_available():
        print("benchmarks/quant_gemm_gpu.py needs a CUDA GPU (torch.cuda.is_available() is False): run it "
              "on a GPU machine, or with --device cpu for an interpreter smoke run.", file=sys.stderr)
        return 2
    table = CPU_SHAPES if args.device == "cpu" else SHAPES
    names = list(table) if args.shapes is None else args.shapes.split(",")
    unknown = [s for s in names if s not in table] + [p for p in args.paths.split(",")
                                                      if p not in PATHS and not re.fullmatch(r"w4a16-k[1-9]\d*", p)]
    if unknown:
        print(f"unknown shape or path: {', '.join(unknown)} (shapes: {', '.join(table)}; paths: "
              f"{', '.join(PATHS)})", file=sys.stderr)
        return 2
    rows = [int(r) for r in (args.rows or ("1,20" if args.device == "cpu" else "1,16,64,256,1024,4096")).split(",")]
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float16
    splits = tuple(int(p[len("w4a16-k"):]) for p in args.paths.split(",") if p.startswith("w4a16-k"))
    from kvmesh.kernels.quant import triton_gemm as tg
    fp8_mma = tg.fp8_mma(torch.device(args.device))
    device_name = torch.cuda.get_device_name() if args.device == "cuda" else "cpu (interpreter)"
    print(f"# {device_name}, {args.dtype}, fp8 path: {'fp8 MMA' if fp8_mma else 'weight-only'}, "
          f"W4A16 group size {GROUP_SIZE}; us per call (median), dense/path, weight GB/s, rel. error")
    print("| shape | M | path | us | dense/path | weight MB | GB/s | rel. error |")
    print("|---|---:|---|---:|---:|---:|---:|---:|")
    g = torch.Generator(device=args.device).manual_seed(0)
    if args.gemv_sweep:
        print("| shape, M | (BLOCK_N, BLOCK_K, warps) | us | dense/gemv | rel. error |")
        print("|---|---|---:|---:|---:|")
        for name in names:
            n, k = table[name]
            w, _ = _weights(torch, n, k, dtype, args.device, g)
            for m in [r for r in rows if r <= 16]:
                x = torch.randn(m, k, device=args.device, dtype=dtype, generator=g)
                dense_ms = _bench(lambda: torch.nn.functional.linear(x, w["dense"]), args.device, args.cudagraph)
                _sweep(torch, w, x, dense_ms, args.device, args.cudagraph, f"{name} {n}x{k}, M {m}")
            del w
        return 0
    for name in names:
        n, k = table[name]
        w, nbytes = _weights(torch, n, k, dtype, args.device, g)
        for m in rows:
            x = torch.randn(m, k, device=args.device, dtype=dtype, generator=g)
            calls = _calls(torch, w, x, fp8_mma, splits)
            times = {}
            for path in [p for p in args.paths.split(",") if p in calls]:
                run, ref = calls[path]
                try:
                    want = ref()[:64]              # the error spot check: the first 64 rows
                    err = (run()[:64].double() - want).abs().max().item() / max(want.abs().max().item(), 1e-30)
                    times[path] = _bench(run, args.device, args.cudagraph)
                except Exception as e:  # noqa: BLE001  (one failing path must not end a GPU session)
                    print(f"| {name} {n}x{k} | {m} | {path} | failed: {type(e).__name__}: "
                          f"{str(e).strip().splitlines()[0][:160]} | | | | |")
                    continue
                ratio = times["dense"] / times[path] if "dense" in times else float("nan")
                moved = nbytes[path.split("-k")[0]]         # w4a16-kN reads w4a16's bytes
                print(f"| {name} {n}x{k} | {m} | {path} | {times[path] * 1e3:.1f} | {ratio:.2f} | "
                      f"{moved / 1e6:.1f} | {moved / times[path] / 1e6:.0f} | {err:.1e} |")
            del x, calls
        del w
        if args.device == "cuda":
            torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
