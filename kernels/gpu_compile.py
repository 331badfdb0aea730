"""Compile every Triton kernel for real NVIDIA GPUs (sm_80, sm_90) without one, at the engine's shapes.

    python -m kvmesh.kernels.gpu_compile                     # table of registers / spills / shared memory
    python -m kvmesh.kernels.gpu_compile --write-docs docs/KERNELS.md

The interpreter accepts code a GPU rejects (tl.dot tiles under 16, too many registers), so the
suite also compiles each kernel for real targets: `triton.compile(ASTSource(fn, signature,
constexprs, attrs), target=GPUTarget("cuda", cc, 32))` runs ptxas and yields a cubin whose
resource usage `cuobjdump --dump-resource-usage` reports (both ship in the Triton wheel).

Where the variants come from: `ENGINE_SHAPES` x `DTYPES` is the one table of engine
configurations, and `LAUNCHES` calls each public kernel function the way the model does for a
shape (decode and prefill batches, the split-K path, MoE decode and prefill tiles). Those calls
run the real launchers on meta-device tensors with `kernel[grid](...)` replaced by a recorder,
so every tile size, warp count and constexpr is the one the launcher picks, and the signature
(argument dtypes, int widths, 16-divisibility) is derived from the recorded arguments the way
Triton's JIT specialises them. A new kernel is covered by adding its public function to
`LAUNCHES`. Must run without TRITON_INTERPRET (the interpreter replaces the JIT functions).
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import re
import subprocess
import sys
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch

from kvmesh.kernels.decode_plan import DEFAULT_MIN_SPLIT_TOKENS

TARGETS = (80, 90)
DTYPES = (torch.bfloat16, torch.float16, torch.float32)
BLOCK_SIZE = 16   # tokens per KV-cache block (the engine's default)


@dataclass(frozen=True, slots=True)
class EngineShape:
    name: str
    hidden: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    num_experts: int = 0        # 0: dense MLP (no MoE kernel)
    top_k: int = 0
    moe_inter: int = 0
    sliding_window: int = 0     # attention window of its sliding layers (0: none)
    softcap: float = 0.0        # attention logit soft-cap (Gemma 2)


# The engine configurations every kernel is compiled at: the built-in model, a Llama-8B-class
# GQA 4:1 model, Mistral-7B (sliding window), Gemma-2-2B (head_dim 256, window, soft-cap), GQA 8:1
# with a MoE (Qwen3-30B-A3B-shaped: 128 experts, top-8) and Mixtral-shaped.
ENGINE_SHAPES = (
    EngineShape("smollm2-135m", 576, 9, 3, 64),
    EngineShape("llama-8b", 4096, 32, 8, 128),
    EngineShape("mistral-7b", 4096, 32, 8, 128, sliding_window=4096),
    EngineShape("gemma2-2b", 2304, 8, 4, 256, sliding_window=4096, softcap=50.0),
    EngineShape("qwen3-moe-30b", 2048, 32, 4, 128, num_experts=128, top_k=8, moe_inter=768),
    EngineShape("mixtral-8x7b", 4096, 32, 8, 128, num_experts=8, top_k=2, moe_inter=14336),
)


def _meta(*shape, dtype):
    return torch.empty(shape, dtype=dtype, device="meta")


def _qkv(s: EngineShape, tokens: int, dtype):
    """q, k, v as the model has them: strided views of the fused QKV projection's output."""
    nq, nkv = s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim
    qkv = _meta(tokens, nq + 2 * nkv, dtype=dtype)
    return (qkv[:, :nq].view(tokens, s.num_heads, s.head_dim),
            qkv[:, nq:nq + nkv].view(tokens, s.num_kv_heads, s.head_dim),
            qkv[:, nq + nkv:].view(tokens, s.num_kv_heads, s.head_dim))


def _cache(s: EngineShape, dtype, num_blocks: int = 64):
    return _meta(num_blocks, BLOCK_SIZE, s.num_kv_heads, s.head_dim, dtype=dtype)


def _launch_norm_rope_cache(s: EngineShape, dtype) -> None:
    from kvmesh.kernels import cache_ops, norm, rope
    tokens = 8
    x = _meta(tokens, s.hidden, dtype=dtype)
    w = _meta(s.hidden, dtype=dtype)
    norm.rms_norm(x, w, 1e-6)
    norm.rms_norm(x, w, 1e-6, x)
    q, k, v = _qkv(s, tokens, dtype)
    rope.rotary_embedding(_meta(tokens, dtype=torch.int64), q, k, _meta(4096, s.head_dim, dtype=torch.float32))
    cache_ops.write_kv_cache(k, v, _cache(s, dtype), _cache(s, dtype), _meta(tokens, dtype=torch.int64))


# the targets a launch made inside `_for_target` is for (the launcher chose its tiles for one
# architecture); everything else is launched the same way on every target
_targets: tuple[int, ...] = TARGETS


@contextmanager
def _for_target(cc: int) -> Iterator[None]:
    global _targets
    saved, _targets = _targets, (cc,)
    try:
        yield
    finally:
        _targets = saved


def _launch_attention(s: EngineShape, dtype, cache_dtype=None) -> None:
    from kvmesh.kernels import paged_attention, prefill_attention
    cache_dtype = cache_dtype or dtype
    seqs, tables = 4, _meta(4, 32, dtype=torch.int32)
    seq_lens, qsl = _meta(seqs, dtype=torch.int32), _meta(seqs + 1, dtype=torch.int32)
    q, _, _ = _qkv(s, seqs, dtype)
    kw = dict(sliding_window=s.sliding_window, softcap=s.softcap)
    # large batches or short contexts: one split; batch 1 at long context: many + the reduce;
    # with the engine's minimum split length (DecodePlanner), as every engine decode runs
    # (per architecture: an 8-bit cache is read as bytes on sm_80, as fp8 on sm_90; a float
    # cache's variants are the same on both and recorded once)
    for arch in TARGETS:
        with _for_target(arch):
            for splits in (1, 16):
                paged_attention.paged_decode_attention(q, _cache(s, cache_dtype), _cache(s, cache_dtype), tables,
                                                       seq_lens, 512, s.head_dim ** -0.5, num_splits=splits,
                                                       min_split_tokens=DEFAULT_MIN_SPLIT_TOKENS, arch=arch, **kw)
    q, _, _ = _qkv(s, 64, dtype)
    for arch in TARGETS:     # the launcher's tiles per architecture (a meta tensor has none)
        with _for_target(arch):
            prefill_attention.unified_attention(q, _cache(s, cache_dtype), _cache(s, cache_dtype), qsl, seq_lens,
                                                tables, s.head_dim ** -0.5, arch=arch, **kw)


# --kv-cache-dtype fp8 / fp8_e5m2 under bf16 models (written as bytes; read as bytes on sm_80, as
# fp8 converted natively on sm_90: fp8_codes.kv_read; under fp16 only the widened tiles' final
# conversion differs)
FP8_CACHES = {torch.bfloat16: (torch.float8_e4m3fn, torch.float8_e5m2)}


def _launch_fp8_cache(s: EngineShape, dtype) -> None:
    from kvmesh.kernels import cache_ops
    for cache_dtype in FP8_CACHES.get(dtype, ()):
        _, k, v = _qkv(s, 8, dtype)
        cache_ops.write_kv_cache(k, v, _cache(s, cache_dtype), _cache(s, cache_dtype),
                                 _meta(8, dtype=torch.int64))
        _launch_attention(s, dtype, cache_dtype)


def _launch_moe(s: EngineShape, dtype) -> None:
    if not s.num_experts:
        return
    from kvmesh.kernels import fused_moe
    w13 = _meta(s.num_experts, 2 * s.moe_inter, s.hidden, dtype=dtype)
    w2 = _meta(s.num_experts, s.hidden, s.moe_inter, dtype=dtype)
    for tokens in (8, 4096):   # a decode batch (16-row tiles) and a prefill batch (64-row tiles)
        fused_moe.fused_moe(_meta(tokens, s.hidden, dtype=dtype), w13, w2,
                            _meta(tokens, s.top_k, dtype=torch.float32),
                            _meta(tokens, s.top_k, dtype=torch.int64))


LORA_RANK = 16          # --max-lora-rank's default; the q/k/v site stacks 3 parts of it
LORA_SLOTS = 4          # --max-loras


def _launch_lora(s: EngineShape, dtype) -> None:
    from kvmesh.kernels import lora_triton
    nq, nkv = s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim
    seg_starts = _meta(LORA_SLOTS + 1, dtype=torch.int32)
    seg_slots = _meta(LORA_SLOTS, dtype=torch.int32)
    for tokens in (8, 2048):   # a decode batch (16-row tiles) and a prefill chunk (64-row tiles)
        x = _meta(tokens, s.hidden, dtype=dtype)
        rows = _meta(tokens, dtype=torch.int64)
        a = _meta(LORA_SLOTS, 3 * LORA_RANK, s.hidden, dtype=dtype)         # the q/k/v site
        b = _meta(LORA_SLOTS, nq + 2 * nkv, 3 * LORA_RANK, dtype=dtype)
        y = lora_triton.sgmv_shrink(x, a, rows, seg_starts, seg_slots, tokens)
        lora_triton.sgmv_expand(y, b, _meta(tokens, nq + 2 * nkv, dtype=dtype), rows, seg_starts,
                                seg_slots, tokens)


def _launch_quant_gemm(s: EngineShape, dtype) -> None:
    """The GEMMs of Hugging Face quantized checkpoints (kernels/quant/triton_gemm.py) on a
    hidden x hidden projection: a decode batch (16 x 32 tiles; the W4A16 GEMV at 1 row) and a
    prefill batch (64 x 128).
    W4A16 at group size 128 (64 where it does not divide hidden), GPTQ act-order with a bias in
    bf16 only (the gather is the one difference), GGUF Q4_1's and Q4_K's groups of 32 with float
    zero points in bf16; FP8 per tensor on both paths (per channel
    differs by one stride), the fp8 MMA path for sm_90 only (sm_80 has no fp8 type)."""
    from kvmesh.kernels.quant import triton_gemm
    n = k = s.hidden
    group = 128 if k % 128 == 0 else 64
    for tokens in (8, 2048):
        x = _meta(tokens, k, dtype=dtype)
        int4 = (_meta(n, k // 2, dtype=torch.uint8), _meta(n, k // group, dtype=dtype),
                _meta(n, k // group, dtype=torch.uint8), group)
        # NOTE: from W4A16_DEQUANT_MIN_ROWS the engine dequantizes for cuBLAS; the fused kernel's
        # large tiles stay reachable (KVMESH_W4A16_DEQUANT_ROWS), so both routes are compiled
        if tokens < triton_gemm.W4A16_DEQUANT_MIN_ROWS:       # decode on a GPU splits K (_split_k)
            triton_gemm.w4a16_gemm(x, *int4, route="kernel", split_k=4)
            triton_gemm.w4a16_gemm(_meta(1, k, dtype=dtype), *int4, route="gemv")   # batch 1: ROWS 1
            if dtype == torch.bfloat16:
                triton_gemm.w4a16_gemm(_meta(1, k, dtype=dtype), *int4, _meta(k, dtype=torch.int64),
                                       _meta(n, dtype=dtype), route="gemv")
        for route in ("auto", "kernel") if tokens >= triton_gemm.W4A16_DEQUANT_MIN_ROWS else ("auto",):
            triton_gemm.w4a16_gemm(x, *int4, route=route)
            if dtype == torch.bfloat16:
                triton_gemm.w4a16_gemm(x, *int4, _meta(k, dtype=torch.int64), _meta(n, dtype=dtype), route=route)
        # GGUF on a GPU (kernels/quant/gguf_int4.py): groups of 32 with float32 zero points (the
        # GEMV's FLOAT_ZERO path), fp16 scales (Q4_1) or float32 ones (Q4_K); Q4_0 differs from
        # AWQ by the group size only
        for scale_dtype in (torch.float16, torch.float32) if dtype == torch.bfloat16 else ():
            gguf_q4 = (_meta(n, k // 2, dtype=torch.uint8), _meta(n, k // 32, dtype=scale_dtype),
                       _meta(n, k // 32, dtype=torch.float32), 32)
            if tokens < triton_gemm.W4A16_DEQUANT_MIN_ROWS:
                triton_gemm.w4a16_gemm(x, *gguf_q4, route="kernel", split_k=4)
                triton_gemm.w4a16_gemm(_meta(1, k, dtype=dtype), *gguf_q4, route="gemv")
            triton_gemm.w4a16_gemm(x, *gguf_q4, route="auto")
        triton_gemm.w8a8_gemm(x, _meta(n, k, dtype=torch.int8), _meta(n, dtype=torch.float32))
        for arch in (80, 90):
            triton_gemm.fp8_gemm(x, _meta(n, k, dtype=torch.float8_e4m3fn), _meta(1, dtype=torch.float32),
                                 arch=arch)
        triton_gemm.fp8_gemm(x, _meta(n, k, dtype=torch.float8_e4m3fn), _meta(n, dtype=torch.float32),
                             activations="token", arch=90)


# GGUF's 8-bit groups on a GPU (kernels/quant/gguf_int8.py): (scales, zeros, group size) of
# the formats: Q8_0 / Q5_0 / IQ4_NL fp16 u8 32; Q5_1 fp16 fp32 32; Q5_K fp32 fp32 32; IQ4_XS fp32
# u8 32; Q6_K / Q3_K fp32 u8 16; Q2_K fp32 fp32 16
W8G_LAYOUTS = ((torch.float16, torch.uint8, 32), (torch.float16, torch.float32, 32),
               (torch.float32, torch.float32, 32), (torch.float32, torch.uint8, 32),
               (torch.float32, torch.uint8, 16), (torch.float32, torch.float32, 16))


def _launch_w8g_gemm(s: EngineShape, dtype) -> None:
    """The 8-bit group GEMM (kernels/quant/triton_w8g.py) of a GGUF file on a GPU, in bf16 (the
    GPU's default dtype) on a hidden x hidden projection: the GEMV at 1 row, the fused kernel at
    8, the dequantization at 2048, for each layout the formats convert to."""
    if dtype != torch.bfloat16:
        return
    from kvmesh.kernels.quant import triton_w8g
    n = k = s.hidden
    for scale_dtype, zero_dtype, group in W8G_LAYOUTS:
        weight = (_meta(n, k, dtype=torch.uint8), _meta(n, k // group, dtype=scale_dtype),
                  _meta(n, k // group, dtype=zero_dtype), group)
        for tokens, route in ((1, "gemv"), (8, "kernel"), (2048, "dequant")):
            triton_w8g.w8g_gemm(_meta(tokens, k, dtype=dtype), *weight, route=route)


# Each entry calls public kernel functions as the engine does for one (shape, dtype).
LAUNCHES: tuple[Callable[[EngineShape, torch.dtype], None], ...] = (
    _launch_norm_rope_cache, _launch_attention, _launch_fp8_cache, _launch_moe, _launch_lora,
    _launch_quant_gemm, _launch_w8g_gemm,
)


@dataclass(frozen=True, slots=True)
class Variant:
    """One compiled specialisation of a kernel: what triton.compile needs, plus where it came from."""
    kernel: str
    fn: Any                      # the JITFunction
    signature: tuple[tuple[str, str], ...]
    constexprs: tuple[tuple[str, Any], ...]
    divisible: tuple[int, ...]   # argument indices specialised as 16-divisible
    num_warps: int
    num_stages: int
    dtype: str                   # the engine dtype it was recorded under
    shapes: tuple[str, ...]      # the engine shapes that launch it
    targets: tuple[int, ...] = TARGETS   # the compute capabilities whose launcher picks it

    @property
    def key(self):
        return (self.kernel, self.signature, self.constexprs, self.divisible, self.num_warps, self.num_stages)


_TYPES = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32", torch.int32: "i32",
          torch.int64: "i64", torch.int8: "i8", torch.uint8: "u8", torch.bool: "i1",
          torch.float8_e4m3fn: "fp8e4nv", torch.float8_e5m2: "fp8e5"}
# NOTE: Triton refuses fp8e4nv (e4m3) before sm_89 (no fp8 conversions nor MMA there); a
# variant with such an argument is compiled for the targets that have it and marked for the others
_MIN_CC = {"fp8e4nv": 89}


def _specialise(value, specialise: bool = True) -> tuple[str, bool, Any]:
    """(signature type, 16-divisible, constexpr value) as Triton's JIT specialises an argument
    (`specialise=False`: a `do_not_specialize` integer, never a constant nor 16-divisible)."""
    if isinstance(value, int) and not isinstance(value, bool) and not specialise:
        return ("i32" if -2 ** 31 <= value < 2 ** 31 else "i64"), False, None
    if isinstance(value, torch.Tensor):
        return "*" + _TYPES[value.dtype], value.storage_offset() * value.element_size() % 16 == 0, None
    if isinstance(value, bool):
        return "u1", False, None
    if isinstance(value, int):
        if value == 1:                            # the JIT turns a 1 into a constant
            return "constexpr", False, 1
        return ("i32" if -2 ** 31 <= value < 2 ** 31 else "i64"), value % 16 == 0, None
    if isinstance(value, float):
        return "fp32", False, None
    if value is None:
        return "constexpr", False, None
    raise TypeError(f"cannot specialise an argument of type {type(value).__name__}")


@contextmanager
def _recording(dtype: torch.dtype, shape: EngineShape, out: dict) -> Iterator[None]:
    """Inside: `kernel[grid](...)` records a Variant instead of launching; the GPU (16-bit tl.dot) path."""
    from triton.runtime.jit import JITFunction

    from kvmesh.kernels import fused_moe, lora_triton, paged_attention, prefill_attention

    def record(fn, grid):
        def launch(*args, num_warps=4, num_stages=3, **kwargs):
            bound = fn.signature.bind(*args, **kwargs)
            sig, consts, div = [], [], []
            for i, (param, (name, value)) in enumerate(zip(fn.params, bound.arguments.items())):
                if param.is_constexpr:
                    sig.append((name, "constexpr"))
                    consts.append((name, value))
                    continue
                ty, divisible, const = _specialise(value, not param.do_not_specialize)
                sig.append((name, ty))
                if ty == "constexpr":
                    consts.append((name, const))
                if divisible:
                    div.append(i)
            v = Variant(fn.__name__, fn, tuple(sig), tuple(consts), tuple(div), num_warps, num_stages,
                        str(dtype).removeprefix("torch."), (shape.name,), _targets)
            if v.key in out:
                old = out[v.key]
                out[v.key] = dataclasses.replace(old, shapes=tuple(dict.fromkeys(old.shapes + v.shapes)),
                                                 targets=tuple(sorted(set(old.targets + v.targets))))
            else:
                out[v.key] = v
        return launch

    modules = (paged_attention, prefill_attention, fused_moe, lora_triton)
    saved = (JITFunction.__getitem__, *(m.upcast_operands for m in modules))
    JITFunction.__getitem__ = record
    for module in modules:
        module.upcast_operands = lambda t: False
    try:
        yield
    finally:
        JITFunction.__getitem__ = saved[0]
        for module, fn in zip(modules, saved[1:]):
            module.upcast_operands = fn


def engine_variants() -> list[Variant]:
    """Every distinct kernel specialisation the engine launches over ENGINE_SHAPES x DTYPES."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise RuntimeError("unset TRITON_INTERPRET: the interpreter replaces the kernels being compiled")
    found: dict = {}
    for dtype in DTYPES:
        for shape in ENGINE_SHAPES:
            with _recording(dtype, shape, found):
                for launch in LAUNCHES:
                    launch(shape, dtype)
    return list(found.values())


def all_kernels() -> set[str]:
    """Names of every `@triton.jit` function named `*_kernel` in the kvmesh.kernels modules (the
    launched kernels; jitted helpers such as `load_kv_tile` are inlined into them)."""
    import importlib
    import pkgutil

    from triton.runtime.jit import JITFunction

    import kvmesh.kernels as pkg
    names = set()
    for info in pkgutil.walk_packages(pkg.__path__, "kvmesh.kernels."):   # subpackages (quant) too
        if info.name.rsplit(".", 1)[-1] in ("bench", "gpu_compile"):
            continue
        module = importlib.import_module(info.name)
        names |= {n for n, obj in vars(module).items() if isinstance(obj, JITFunction) and n.endswith("_kernel")}
    return names


@dataclass(frozen=True, slots=True)
class Resources:
    cc: int
    registers: int
    stack: int          # bytes of stack frame per thread (> 0: spills)
    local: int          # bytes of local memory per thread (> 0: spills)
    shared: int         # bytes of shared memory per block (Triton's dynamic allocation)
    error: str = ""
    unsupported: str = ""   # why this target cannot run the variant (not compiled, not a failure)

    @property
    def spills(self) -> bool:
        return self.stack > 0 or self.local > 0


def _cuobjdump(cubin: bytes) -> dict[str, int]:
    import triton
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run([tool, "--dump-resource-usage", f.name], capture_output=True, text=True,
                              check=True).stdout
    fields = dict(re.findall(r"(REG|STACK|SHARED|LOCAL):(\d+)", text))
    if "REG" not in fields:
        raise RuntimeError(f"no resource usage in cuobjdump output: {text[:200]!r}")
    return {k: int(v) for k, v in fields.items()}


def compile_variant(v: Variant, cc: int) -> Resources:
    """Compile for sm_<cc> (ptxas included) and read the cubin's resource usage."""
    if cc not in v.targets:
        return Resources(cc, 0, 0, 0, 0, unsupported=f"n/a: sm_{cc} launches another variant")
    for _, ty in v.signature:
        if cc < _MIN_CC.get(ty.lstrip("*"), 0):
            return Resources(cc, 0, 0, 0, 0, unsupported=f"n/a: {ty.lstrip('*')} needs sm_{_MIN_CC[ty.lstrip('*')]}+")
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    attrs = {(i,): [["tt.divisibility", 16]] for i in v.divisible}
    src = ASTSource(v.fn, dict(v.signature), dict(v.constexprs), attrs)
    try:
        k = triton.compile(src, target=GPUTarget("cuda", cc, 32),
                           options={"num_warps": v.num_warps, "num_stages": v.num_stages})
    except Exception as e:  # noqa: BLE001  (a compile error is the finding)
        return Resources(cc, 0, 0, 0, 0, f"{type(e).__name__}: {str(e).strip().splitlines()[-1][:200]}")
    r = _cuobjdump(k.asm["cubin"])
    return Resources(cc, r["REG"], r.get("STACK", 0), r.get("LOCAL", 0), int(k.metadata.shared))


_SHOWN = ("GROUP", "HEAD_DIM", "BLOCK_SIZE", "BLOCK_G", "BLOCK_Q", "BLOCK_M", "BLOCK_N", "BLOCK_K",
          "BLOCK_D", "NUM_SPLITS", "MIN_CHUNK", "BLOCK_S", "BLOCK_H", "BLOCK_HALF", "HALF", "BLOCK", "HAS_RESIDUAL",
          "A_DIV", "MUL_WEIGHT", "USE_SOFTCAP", "KV_CODE", "EXPAND", "NUM_STAGES", "WEIGHT_ONLY", "perm_ptr",
          "bias_ptr")


def describe(v: Variant) -> str:
    consts = dict(v.constexprs)
    return " ".join(f"{k}={int(consts[k]) if isinstance(consts[k], bool) else consts[k]}"
                    for k in _SHOWN if k in consts)


def compile_all(ccs=TARGETS) -> list[tuple[Variant, list[Resources]]]:
    variants = sorted(engine_variants(), key=lambda v: (v.kernel, v.dtype, describe(v)))
    return [(v, [compile_variant(v, cc) for cc in ccs]) for v in variants]


def markdown(results, ccs=TARGETS) -> str:
    head = ("| kernel | dtype | constexprs | warps | shapes | "
            + " | ".join(f"sm_{cc} regs / stack / local / shared" for cc in ccs) + " |")
    lines = [head, "|" + "---|" * (5 + len(ccs))]
    for v, res in results:
        cells = [r.unsupported or r.error or f"{r.registers} / {r.stack} / {r.local} / {r.shared}" for r in res]
        lines.append(f"| `{v.kernel}` | {v.dtype} | {describe(v)} | {v.num_warps} | "
                     f"{', '.join(v.shapes)} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


BEGIN, END = "<!-- gpu_compile table: begin -->", "<!-- gpu_compile table: end -->"


def write_docs(path: str, table: str) -> None:
    text = open(path).read()
    if BEGIN not in text or END not in text:
        raise SystemExit(f"{path} has no {BEGIN} ... {END} section to replace")
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    with open(path, "w") as f:
        f.write(f"{head}{BEGIN}\n{table}\n{END}{tail}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cc", default=",".join(map(str, TARGETS)), help="compute capabilities, comma-separated")
    ap.add_argument("--write-docs", metavar="FILE", help="replace the table section of FILE (docs/KERNELS.md)")
    a = ap.parse_args(argv)
    ccs = tuple(int(c) for c in a.cc.split(","))
    results = compile_all(ccs)
    table = markdown(results, ccs)
    print(table)
    if a.write_docs:
        write_docs(a.write_docs, table)
    missing = sorted(all_kernels() - {v.kernel for v, _ in results})
    for name in missing:
        print(f"FAIL {name}: never launched by LAUNCHES; add its public function there", file=sys.stderr)
    bad = [(v, r) for v, res in results for r in res if r.error or r.spills]
    for v, r in bad:
        print(f"FAIL sm_{r.cc} {v.kernel} {v.dtype} {describe(v)}: "
              f"{r.error or f'spills (stack {r.stack} B, local {r.local} B)'}", file=sys.stderr)
    print(f"{len(results)} variants x {len(ccs)} targets compiled, {len(bad)} failed or spilled", file=sys.stderr)
    return 1 if bad or missing else 0


if __name__ == "__main__":
    sys.exit(main())
