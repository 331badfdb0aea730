"""`make test-vllm` only: these tests run real vLLM engines (a separate ~3 GB venv, minutes of
start-up). `make test` leaves them out; KVMESH_TEST_VLLM=1 (set by `make test-vllm`) runs them."""
import os

if os.environ.get("KVMESH_TEST_VLLM") != "1":
    collect_ignore_glob = ["test_*.py"]
