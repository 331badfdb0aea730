"""benchmarks/pyspy_summary.py on a hand-written raw profile: categories, JIT frames, filters."""
from __future__ import annotations

from benchmarks.pyspy_summary import summarize

RAW = """\
main (run.py:1);execute_model (runner.py:9);onednn_mm (ops.py:3);0x7f78d48a3f16 (?) 7
main (run.py:1);execute_model (runner.py:9);paged_attention_rows (cpu_attention.cpp:120) 5
main (run.py:1);execute_model (runner.py:9);rms_norm (norm.py:3) 2
main (run.py:1);_dummy_run (runner.py:40);execute_model (runner.py:9);0x7f78d48a3f20 (?) 4
main (run.py:1);worker (w.py:2);gomp_team_barrier_wait (libgomp.so) 9
main (run.py:1);compile_graph (c.py:5) 3
"""


def test_categories_and_bare_addresses_are_jit_gemm_code():
    counts, total = summarize(RAW.splitlines())
    assert total == 30
    assert counts == {"jit (oneDNN's generated GEMM code)": 11, "attention": 5, "norm/rope/act": 2,
                      "idle": 9, "other (Python glue, torch dispatch)": 3}


def test_only_and_exclude_keep_the_timed_phase():
    counts, total = summarize(RAW.splitlines(), only="execute_model", exclude="dummy_run")
    assert total == 14
    assert counts == {"jit (oneDNN's generated GEMM code)": 7, "attention": 5, "norm/rope/act": 2}
