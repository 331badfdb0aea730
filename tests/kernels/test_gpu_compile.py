"""Every Triton kernel compiles for real GPUs (sm_80, sm_90) at the engine's configurations, with
no register spills, and docs/KERNELS.md holds the current resource table.

The compilation runs in a subprocess without TRITON_INTERPRET (tests/conftest.py sets it for
this process, and the interpreter replaces the JIT functions being compiled).
"""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("triton")

ROOT = Path(__file__).resolve().parents[2]


def _python(code_or_args: list[str], timeout: float = 1500) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"   # Triton 3.9's default, without its warning
    return subprocess.run([sys.executable, *code_or_args], capture_output=True, text=True, env=env,
                          cwd=ROOT, timeout=timeout)


@pytest.fixture(scope="module")
def compiled():
    proc = _python(["-m", "kvmesh.kernels.gpu_compile"])
    return proc


# NOTE: ~170 compilations take ~4 min with a cold Triton cache on the shared 2-core machine (~15 s
# warm); the fixture's time counts against the first test.
@pytest.mark.timeout(1800)
def test_every_kernel_compiles_without_spills(compiled):
    assert compiled.returncode == 0, compiled.stderr[-4000:]
    assert "0 failed or spilled" in compiled.stderr
    rows = [line for line in compiled.stdout.splitlines() if line.startswith("| `")]
    kernels = {row.split("`")[1] for row in rows}
    assert kernels == {"_write_kv_cache_kernel", "_decode_split_kernel", "_decode_reduce_kernel",
                       "_unified_attention_kernel", "_rms_norm_kernel", "_rope_kernel",
                       "_grouped_gemm_kernel", "_sgmv_kernel",
                       "_w4a16_kernel", "_w4a16_gemv_kernel", "_split_k_reduce_kernel", "_dequant_int4_kernel", "_rows_quant_kernel", "_fp8_quant_kernel", "_scaled_gemm_kernel",
                       "_w8g_kernel", "_w8g_gemv_kernel", "_dequant_w8g_kernel"}
    unsupported = [row for row in rows if "n/a" in row]
    # the fp8 MMA variants (fp8e4nv operands) exist for sm_90 only: Triton has no e4m3 before sm_89
    fp8_mma = [row for row in unsupported if "`_scaled_gemm_kernel`" in row]
    assert fp8_mma and all("WEIGHT_ONLY=0" in row and row.split("|")[6].strip() == "n/a: fp8e4nv needs sm_89+"
                           for row in fp8_mma)
    # the unified kernel's tiles are chosen per architecture: sm_90's 128-row 16-bit tiles are
    # compiled for sm_90 only, sm_80's for sm_80 (the same tiles where both pick them); an 8-bit
    # cache is read as bytes on sm_80 (KV_CODE 1 / 2) and as fp8 on sm_90 (3 / 4, fp8_codes.kv_read)
    per_arch = [row for row in unsupported if row not in fp8_mma]
    # (and the decode's tiles: 128 tokens over fp8 converted on sm_90, its reduce with them)
    assert per_arch and all(("`_unified_attention_kernel`" in row or "`_decode_split_kernel`" in row
                             or "`_decode_reduce_kernel`" in row and "BLOCK_N=128" in row)
                            and "launches another variant" in row for row in per_arch)
    assert {row.split("|")[6].strip() for row in per_arch if "BLOCK_M=128" in row} == {
        "n/a: sm_80 launches another variant"}
    code = {row: int(row.split("KV_CODE=")[1].split()[0]) for row in per_arch if "KV_CODE=" in row}
    assert {c for row, c in code.items() if "n/a: sm_80" in row} >= {3, 4}
    assert {c for row, c in code.items() if "n/a: sm_90" in row} >= {1, 2}
    decode = [row for row in per_arch if "`_decode_split_kernel`" in row]
    assert decode and all(code[row] != 0 for row in decode)   # float caches: one variant for both
    for row in rows:                                # every target reports registers, no stack, no local
        for cell in row.strip("|").split("|")[5:]:
            if cell.strip().startswith("n/a"):
                continue
            regs, stack, local, _ = (int(x) for x in cell.split("/"))
            assert 0 < regs <= 255 and stack == 0 and local == 0, row


def test_docs_hold_the_current_table(compiled):
    docs = (ROOT / "docs" / "KERNELS.md").read_text()
    section = docs.split("<!-- gpu_compile table: begin -->\n", 1)[1].split("\n<!-- gpu_compile table: end -->")[0]
    assert section == compiled.stdout.strip(), (
        "docs/KERNELS.md is stale: run `python -m kvmesh.kernels.gpu_compile --write-docs docs/KERNELS.md` "
        "without TRITON_INTERPRET")


def test_compiling_catches_what_the_interpreter_accepts(tmp_path):
    """An 8x8 fp16 tl.dot runs in the interpreter but does not compile for sm_80; a kernel whose
    tiles cannot fit in registers is reported as spilling."""
    (tmp_path / "bad_kernels.py").write_text(textwrap.dedent('''
        import triton
        import triton.language as tl

        @triton.jit
        def small_dot_kernel(a_ptr, b_ptr, c_ptr, BLOCK: tl.constexpr):
            offs = tl.arange(0, BLOCK)
            a = tl.load(a_ptr + offs[:, None] * BLOCK + offs[None, :])
            b = tl.load(b_ptr + offs[:, None] * BLOCK + offs[None, :])
            tl.store(c_ptr + offs[:, None] * BLOCK + offs[None, :], tl.dot(a, b))

        @triton.jit
        def big_tile_kernel(a_ptr, c_ptr, BLOCK: tl.constexpr):
            offs = tl.arange(0, BLOCK)
            a = tl.load(a_ptr + offs[:, None] * BLOCK + offs[None, :])
            b = tl.load(a_ptr + BLOCK * BLOCK + offs[:, None] * BLOCK + offs[None, :])
            tl.store(c_ptr + offs[:, None] * BLOCK + offs[None, :], tl.dot(a, b))
    '''))
    code = textwrap.dedent(f'''
        import sys
        sys.path.insert(0, {str(tmp_path)!r})
        import bad_kernels
        from kvmesh.kernels.gpu_compile import Variant, compile_variant

        def variant(fn, sig, block, warps=1):
            return Variant(fn.__name__, fn, tuple(sig) + (("BLOCK", "constexpr"),), (("BLOCK", block),),
                           (), warps, 1, "float32", ())

        fp16 = [(n + "_ptr", "*fp16") for n in "abc"]
        ok = compile_variant(variant(bad_kernels.small_dot_kernel, fp16, 16), 80)
        small = compile_variant(variant(bad_kernels.small_dot_kernel, fp16, 8), 80)
        big = compile_variant(variant(bad_kernels.big_tile_kernel, [("a_ptr", "*fp32"), ("c_ptr", "*fp32")], 128), 90)
        print("ok", ok.error == "", ok.spills)
        print("small", bool(small.error))
        print(small.error)
        print("big", big.error == "", big.spills)
    ''')
    proc = _python(["-c", code], timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert lines[0] == "ok True False" and lines[1] == "small True" and lines[3] == "big True True", proc.stdout
    assert "K >= 16" in lines[2]                    # ptx-bound codegen rejects the 8x8 fp16 dot
