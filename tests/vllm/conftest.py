"""`make test-vllm` only: these tests run real vLLM engines (a separate ~3 GB venv, minutes of
start-up). `make test` collects them and skips each with the reason (pytest's -ra lists it);
KVMESH_TEST_VLLM=1 (set by `make test-vllm`) runs them."""
import os
from pathlib import Path

import pytest

ENABLED = os.environ.get("KVMESH_TEST_VLLM") == "1"
SKIP_REASON = ("{name} runs real vLLM engines: set KVMESH_TEST_VLLM=1 with vLLM in "
               "KVMESH_VLLM_VENV (`make test-vllm` installs it and does both)")
HERE = Path(__file__).parent


def pytest_collection_modifyitems(config, items):
    # NOTE: a conftest's hook sees the whole session's items: mark only this folder's. The
    # test's name is in the reason because -ra folds equal skip reasons of one file into a line.
    if ENABLED:
        return
    for item in items:
        if HERE in item.path.parents:
            item.add_marker(pytest.mark.skip(reason=SKIP_REASON.format(name=item.name)))
