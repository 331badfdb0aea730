"""The e2e suite's shared server (one `kvmesh serve` process) and openai clients."""
from __future__ import annotations

import pytest
from processes import free_port  # noqa: F401  (tests/support; re-exported)
from servers import ServerProcess, start_server  # noqa: F401  (tests/support)

API_KEY = "test-key"


@pytest.fixture(scope="session")
def server(tmp_path_factory):
    """One engine server for the e2e tests (API key on, room for 64 concurrent clients).

    NOTE: float32 and dequantized weights asked for explicitly: its outputs are compared token
    for token with the in-process float32 engine and with transformers (`--dtype auto` serves
    bfloat16 on a CPU with AVX512-BF16 or AMX, and `--quantization auto` the GGUF's blocks, whose
    float32 sums differ from the dense GEMM's in the last bits)."""
    srv = start_server(tmp_path_factory.mktemp("server"), "--dtype", "float32", "--quantization", "none",
                       "--api-key", API_KEY,
                       "--num-kv-blocks", "768", "--max-num-seqs", "64", "--max-model-len", "2048",
                       "--max-waiting", "256")
    yield srv
    code = srv.stop()
    assert code == 0, f"exit code {code}:\n{srv.log()[-3000:]}"


@pytest.fixture
def client(server):
    from openai import OpenAI
    return OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=120)


@pytest.fixture
def async_client(server):
    from openai import AsyncOpenAI
    return AsyncOpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=120)


def metric(text: str, name: str) -> float:
    """The value of one un-labelled-by-reason sample (model_name label) in a Prometheus page."""
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    raise KeyError(name)
