"""Summarise a py-spy raw profile (`py-spy record --native -f raw`) into the step's parts.

    py-spy record --native -r 50 -f raw -o /tmp/p.txt --pid PID --duration 60
    python benchmarks/pyspy_summary.py /tmp/p.txt
    python benchmarks/pyspy_summary.py /tmp/vllm.txt --only execute_model --exclude 'dummy_run|profile_run'

Each sample (one stack, with its count) goes to the first category whose pattern matches a
frame, innermost frame first; categories name what the time is spent on (GEMM libraries, the
attention kernels, the norm / RoPE / activation code, sampling, the scheduler, Python glue), for
kvmesh's and vLLM's processes alike. Idle threads (waiting on a lock, a queue, a socket, an
OpenMP barrier) are counted apart and left out of the shares.

Code generated at run time has no symbols: a stack whose innermost frame is a bare address
(`0x7f... (?)`) is counted as `jit`, which in a CPU vLLM or kvmesh process is oneDNN's generated
GEMM code (its brgemm kernels; nothing else there generates machine code at run time).
`--only REGEX` keeps the stacks with a frame that matches (e.g. the timed phase's
`execute_model`), `--exclude REGEX` drops those with one (start-up runs).
"""
from __future__ import annotations

import argparse
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


_BARE_ADDRESS = re.compile(r"^0x[0-9a-f]+ \(\?\)$")


def categorize(stack: list[str]) -> str:
    if stack and _BARE_ADDRESS.match(stack[-1].strip()):
        return "jit (oneDNN's generated GEMM code)"
    for frame in reversed(stack):        # innermost last in py-spy's raw lines
        for name, pattern in CATEGORIES:
            if re.search(pattern, frame):
                return name
    return "other (Python glue, torch dispatch)"


def summarize(lines: list[str], only: str | None = None,
              exclude: str | None = None) -> tuple[Counter, int]:
    counts: Counter = Counter()
    for line in lines:
        line = line.rstrip("\n")
        if not line:
            continue
        stack_text, _, n = line.rpartition(" ")
        if not n.isdigit():
            continue
        stack = stack_text.split(";")
        if only and not any(re.search(only, f) for f in stack):
            continue
        if exclude and any(re.search(exclude, f) for f in stack):
            continue
        counts[categorize(stack)] += int(n)
    return counts, sum(counts.values())


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("profile", help="py-spy record --native -f raw output")
    p.add_argument("--only", default=None, help="keep stacks with a frame matching this regex")
    p.add_argument("--exclude", default=None, help="drop stacks with a frame matching this regex")
    args = p.parse_args(argv)
    with open(args.profile) as f:
        counts, total = summarize(f.readlines(), args.only, args.exclude)
    busy = total - counts.get("idle", 0)
    print(f"# {args.profile}: {total} samples, {busy} busy")
    print("| part | samples | share of busy |")
    print("|---|---:|---:|")
    for name, n in counts.most_common():
        if name != "idle":
            print(f"| {name} | {n} | {100 * n / max(busy, 1):.1f}% |")
    print(f"| (idle) | {counts.get('idle', 0)} | |")


if __name__ == "__main__":
    main()
