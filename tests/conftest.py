"""Suite-wide settings. Sub-folders keep their own fixtures in their own conftest.py."""
import os

# NOTE: Triton reads this when @triton.jit decorates, so it must be set before any kernel
# module is imported; on this CPU-only machine every kernel test runs in the interpreter.
os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import sys  # noqa: E402
from pathlib import Path  # noqa: E402

# NOTE: tests/ is no package (pytest --import-mode=importlib); helpers shared by several test
# folders live in tests/support and are imported by module name.
sys.path.insert(0, str(Path(__file__).parent / "support"))

import functools  # noqa: E402

import kernel_builds  # noqa: E402  (tests/support)
import pytest  # noqa: E402


def pytest_collection_finish(session):
    # NOTE: the kernel tests' path builds start now, in the background at the lowest priority,
    # and take the CPU the earlier server tests leave idle (tests/support/kernel_builds.py)
    if session.config.option.collectonly:
        return
    root = Path(session.config.rootpath)
    session.config._kernel_builds = kernel_builds.start(
        [Path(item.path).relative_to(root).as_posix() for item in session.items
         if Path(item.path).is_relative_to(root)])


def pytest_sessionfinish(session):
    kernel_builds.stop(getattr(session.config, "_kernel_builds", None))


@pytest.fixture(scope="session")
def smollm():
    """The built-in SmolLM2-135M-Instruct, loaded once (float32, CPU) and shared by engines.

    Dequantized (quantization="none"): the tests that share it compare with transformers' float32
    load of the same file token for token; serving the blocks is tested in
    tests/models/test_gguf_quantized.py."""
    from kvmesh.engine.loader import load_model
    return load_model(None, dtype="float32", device="cpu", quantization="none")


@pytest.fixture(scope="session")
def hf_smollm():
    """transformers' own load of the same GGUF: the reference for token-for-token equality."""
    import torch
    from transformers import AutoModelForCausalLM

    from kvmesh.common.model_files import builtin_model_path
    path = builtin_model_path()
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                 dtype=torch.float32)
    return model.eval()


def hf_greedy_tokens(model, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """Plain greedy decoding with transformers' KV cache: argmax each step, no EOS stop."""
    import torch
    out: list[int] = []
    with torch.no_grad():
        ids = torch.tensor([prompt_ids])
        past = None
        for _ in range(max_new_tokens):
            res = model(input_ids=ids, past_key_values=past, use_cache=True)
            past = res.past_key_values
            nxt = int(res.logits[0, -1].argmax())
            out.append(nxt)
            ids = torch.tensor([[nxt]])
    return out


@pytest.fixture(scope="session")
def hf_greedy(hf_smollm):
    """hf_greedy(prompt_ids, n) -> n greedy token ids from transformers (memoised)."""
    @functools.lru_cache(maxsize=None)
    def run(prompt: tuple[int, ...], n: int) -> tuple[int, ...]:
        return tuple(hf_greedy_tokens(hf_smollm, list(prompt), n))
    return lambda prompt, n: list(run(tuple(prompt), n))


@pytest.fixture(scope="session")
def greedy_reference():
    """The plain transformers greedy loop, for models other than the built-in one."""
    return hf_greedy_tokens
