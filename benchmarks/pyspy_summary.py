"""Summarise a py-spy raw profile (`py-spy record --native -f raw`) into the step's parts.

    py-spy record --native -r 50 -f raw -o /tmp/p.txt --pid PID --duration 60
    python benchmarks/pyspy_summary.py /tmp/p.txt

Each sample (one stack, with its count) goes to the first category whose pattern matches a
frame, innermost frame first; categories name what the time is spent on (GEMM libraries, the
attention kernels, the norm / RoPE / activation code, sampling, the scheduler, Python glue), for
kvmesh's and vLLM's processes alike. Idle threads (waiting on a lock, a queue, a socket, an
OpenMP barrier) are counted apart and left out of the shares.
"""
from __future__ import annotations

import re
import sys
from collections import Counter

# (category, regex over one frame); first match from the innermost frame wins
CATEGORIES: list[tuple[str, str]] = [
    ("idle", r"(?i)\b(wait|futex|epoll|select|poll|sleep|_recv|recv_|acquire|gomp_barrier|"
             r"gomp_team_barrier|sched_yield|do_wait|Condition|queue\.py|shm_broadcast)"),
    ("gemm", r"(?i)(dnnl|mkldnn|onednn|brgemm|jit_uni|jit_avx|gemm|sgemm|mkl_blas|_linear_pointwise|"
             r"addmm|at::native::cpublas|linear \()"),
    ("attention", r"(?i)(paged_attention|attention_rows|cpu_attn|scaled_dot_product|flash_attention|"
                  r"_attend|_decode_group|_extend_one|_gather_context|attn|attention)"),
    ("kv_write", r"(?i)(write_kv_cache|reshape_and_cache|index_copy)"),
    ("norm/rope/act", r"(?i)(rms_norm|rmsnorm|rotary|rope|silu|act_and_mul|gelu)"),
    ("sampling", r"(?i)(sampler|sample|argmax|log_softmax|logits|topk)"),
    ("scheduler", r"(?i)(scheduler|schedule|kv_cache_manager|block_pool|allocate_slots)"),
    ("output/detokenize", r"(?i)(output_processor|detokeniz|decode_token|process_outputs|tokenizers)"),
    ("input prep", r"(?i)(prepare_inputs|_prepare|metadata|input_batch|build\b|AttentionMetadata)"),
]


def categorize(stack: list[str]) -> str:
    for frame in reversed(stack):        # innermost last in py-spy's raw lines
        for name, pattern in CATEGORIES:
            if re.search(pattern, frame):
                return name
    return "other (Python glue, torch dispatch)"


def summarize(lines: list[str]) -> tuple[Counter, int]:
    counts: Counter = Counter()
    for line in lines:
        line = line.rstrip("\n")
        if not line:
            continue
        stack_text, _, n = line.rpartition(" ")
        if not n.isdigit():
            continue
        counts[categorize(stack_text.split(";"))] += int(n)
    return counts, sum(counts.values())


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        raise SystemExit("usage: pyspy_summary.py RAW_PROFILE")
    with open(argv[0]) as f:
        counts, total = summarize(f.readlines())
    busy = total - counts.get("idle", 0)
    print(f"# {argv[0]}: {total} samples, {busy} busy")
    print("| part | samples | share of busy |")
    print("|---|---:|---:|")
    for name, n in counts.most_common():
        if name != "idle":
            print(f"| {name} | {n} | {100 * n / max(busy, 1):.1f}% |")
    print(f"| (idle) | {counts.get('idle', 0)} | |")


if __name__ == "__main__":
    main()
