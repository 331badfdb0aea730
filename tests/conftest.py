"""Suite-wide settings. Sub-folders keep their own fixtures in their own conftest.py."""
import os

# NOTE: Triton reads this when @triton.jit decorates, so it must be set before any kernel
# module is imported; on this CPU-only machine every kernel test runs in the interpreter.
os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
