"""The router and the operator import the prefix-index package: it must not pull in torch."""
from __future__ import annotations

import subprocess
import sys

MODULES = ("layout", "publisher", "lookup", "hashing", "purge", "serve", "kv_bytes",
           "vllm_wire", "zmq_events", "vllm_subscriber", "vllm_chain")


def test_index_package_imports_without_torch():
    code = ("import importlib, sys\n"
            "import kvmesh.index\n"
            f"for m in {MODULES!r}: importlib.import_module('kvmesh.index.' + m)\n"
            "import kvmesh.operator.redis_cleanup, kvmesh.common.kv_events\n"
            "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
