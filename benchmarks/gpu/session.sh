#!/bin/bash
# A lent GPU machine's session in one command (docs/BENCHMARKS.md, "Triton kernels and the engine
# on a GPU"). The machine has its own torch / triton and no package index:
#
#   benchmarks/gpu/session.sh prepare        # here: the wheels it lacks into .gpu/wheels (~16 MB),
#                                            # the built-in tokenizer's files into .gpu/tokenizer
#   benchmarks/gpu/session.sh run [tests|bench|engine|kv8|all]   # there, from the checkout's root,
#                                            # with .gpu carried; results under $OUT
#
# `run` installs the wheels into /tmp/kvsite, maps the package as setuptools does (kvmesh =
# services/, kvmesh.kernels = kernels/, kvmesh.operator = operator/kvmesh_operator) with
# symlinks, sets TRITON_INTERPRET=0 and runs the quantized GEMM tests, the HF quantized
# checkpoints and GGUF files (int4 and 8-bit groups) on CUDA (a server included), a bf16 model against its float32 self through every
# attention route, benchmarks/quant_gemm_gpu.py ($BENCH_ARGS) and the engine on random-1b
# quantized ($ENGINE_QUANTS: awq w8a8 fp8) beside the same checkpoint dequantized to bf16,
# decode-heavy (benchmarks/offline_throughput.py --quantization auto,none). `kv8` (not in `all`):
# the 8-bit KV cache, its compiled-kernel tests, the decode kernel over bf16 / e4m3 / e5m2 caches,
# one engine decode step at a long context (its top kernels by device time from torch's profiler)
# and decode-heavy, each with --kv-cache-dtype auto / fp8.
set -u
ROOT=$(pwd)
case "${1:-}" in
prepare)
    mkdir -p .gpu/wheels
    PIP=${PIP:-.venv/bin/pip}
    "${PYTHON:-.venv/bin/python}" benchmarks/models.py --write-tokenizer .gpu/tokenizer || exit 1
    exec "$PIP" download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 \
        -d .gpu/wheels -r benchmarks/gpu/carry-requirements.txt ;;
run) ;;
*) echo "usage: $0 prepare | run [tests|bench|engine|kv8|all]" >&2; exit 2 ;;
esac
STEP=${2:-all}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
SITE=/tmp/kvsite; PKG=/tmp/kvpkg
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; python3 --version
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_capability())"; } 2>&1 | tee "$OUT/env.txt"
python3 -m pip install -q --no-index --no-deps --target $SITE .gpu/wheels/*.whl > "$OUT/pip.txt" 2>&1; echo "pip rc=$?"
rm -rf $PKG && mkdir -p $PKG/kvmesh
for f in services/*; do ln -s "$ROOT/$f" "$PKG/kvmesh/$(basename "$f")"; done
ln -s "$ROOT/kernels" $PKG/kvmesh/kernels; ln -s "$ROOT/operator/kvmesh_operator" $PKG/kvmesh/operator
export PYTHONPATH=$PKG:$ROOT:$SITE TRITON_INTERPRET=0 PYTHONUNBUFFERED=1
if [ "$STEP" = all ] || [ "$STEP" = tests ]; then
    timeout 100 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_quant_triton_gemm.py \
        tests/kernels/test_quant_triton_w8g.py > "$OUT/tests_kernels.txt" 2>&1; echo "kernel tests rc=$?"; tail -5 "$OUT/tests_kernels.txt"
    timeout 150 python3 -m pytest -q -p no:cacheprovider -rA -s tests/models/test_hf_quantized.py \
        tests/models/test_gguf_gpu.py -k "cuda or layer_keeps" > "$OUT/tests_models.txt" 2>&1
    echo "model tests rc=$?"
    grep -E "on cuda:|passed|failed|Error" "$OUT/tests_models.txt" | tail -25
    # bf16 attention on the GPU: the flash prefill route (torch's varlen_attn) and the Triton kernels
    timeout 120 python3 -m pytest -q -p no:cacheprovider -rA -s tests/kernels/test_flash_prefill.py \
        tests/models/test_bf16_devices.py -k "gpu or cuda" > "$OUT/tests_bf16.txt" 2>&1
    echo "bf16 attention tests rc=$?"; grep -E "bf16 on|passed|failed|Error" "$OUT/tests_bf16.txt" | tail -8
    # --kv-cache-dtype fp8 on the compiled kernels: the write's codes, decode / unified / flash reads
    timeout 300 python3 -m pytest -q -p no:cacheprovider -rA tests/kernels/test_kv_cache_fp8_triton.py \
        tests/engine/test_kernel_warmup.py > "$OUT/tests_fp8_kv.txt" 2>&1
    echo "fp8 KV tests rc=$?"; grep -E "passed|failed|Error" "$OUT/tests_fp8_kv.txt" | tail -8
fi
if [ "$STEP" = all ] || [ "$STEP" = bench ]; then
    # shellcheck disable=SC2086
    timeout 200 python3 benchmarks/quant_gemm_gpu.py ${BENCH_ARGS:-} > "$OUT/quant_gemm_gpu.txt" 2>&1
    echo "bench rc=$?"; head -200 "$OUT/quant_gemm_gpu.txt"
fi
if [ "$STEP" = all ] || [ "$STEP" = engine ]; then
    for q in ${ENGINE_QUANTS:-awq w8a8 fp8}; do
        timeout "${ENGINE_TIMEOUT:-200}" python3 benchmarks/offline_throughput.py --device cuda \
            --dtype bfloat16 --model "${ENGINE_MODEL:-random-1b}-$q" --tokenizer .gpu/tokenizer \
            --model-cache /tmp/kvmodels --systems kvmesh --quantization auto,none \
            --workload decode-heavy --max-num-seqs "${ENGINE_SEQS:-64}" > "$OUT/engine_$q.txt" 2>&1
        echo "engine $q rc=$?"; grep -E "^# (kvmesh|model|workload)|^\| kvmesh|x output|Error" "$OUT/engine_$q.txt" | tail -12
    done
fi
if [ "$STEP" = kv8 ]; then
    timeout 240 python3 -m pytest -q -p no:cacheprovider -rA tests/kernels/test_kv_cache_fp8_triton.py \
        tests/engine/test_kernel_warmup.py -k "compiled or after_start_up" > "$OUT/kv8_tests.txt" 2>&1
    echo "fp8 KV tests rc=$?"; grep -E "PASSED|FAILED|passed|failed|Error" "$OUT/kv8_tests.txt" | tail -12
    timeout 90 python3 benchmarks/paged_decode_kernel.py --batches 16 64 --contexts 2048 8192 32768 \
        --kv-cache-dtypes auto fp8_e4m3 fp8_e5m2 --fp8-bit-path > "$OUT/kv8_kernel.txt" 2>&1
    echo "decode kernel rc=$?"; cat "$OUT/kv8_kernel.txt"
    for kv in auto fp8; do
        timeout 120 python3 benchmarks/decode_bandwidth.py --device cuda --dtype bfloat16 --model random-1b \
            --tokenizer .gpu/tokenizer --model-cache /tmp/kvmodels --batch 64 --context "${KV8_CONTEXT:-4096}" \
            --kv-cache-dtype $kv --torch-profile 8 > "$OUT/kv8_step_$kv.txt" 2>&1
        echo "decode step kv=$kv rc=$?"; grep -E "^# (model|20)|^\|" "$OUT/kv8_step_$kv.txt" | tail -4
        sed -n '/^# torch.profiler/,$p' "$OUT/kv8_step_$kv.txt" | cut -c1-160 | head -16
    done
    timeout 150 python3 benchmarks/offline_throughput.py --device cuda --dtype bfloat16 --model random-1b \
        --tokenizer .gpu/tokenizer --model-cache /tmp/kvmodels --systems kvmesh --kv-cache-dtype auto,fp8 \
        --workload decode-heavy --max-num-seqs 64 > "$OUT/kv8_engine.txt" 2>&1
    echo "engine rc=$?"; grep -E "^# (kvmesh|model|workload)|^\| kvmesh|x output|identical|Error" "$OUT/kv8_engine.txt" | tail -12
fi
