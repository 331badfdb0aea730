"""Tokenizer sources: errors that say what to pass, and the router's path (import and tokenize)
without torch and without the model's weights."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from kvmesh.prompt.sources import load_tokenizer


def test_load_tokenizer_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="--tokenizer"):
        load_tokenizer("some-served-name")
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        load_tokenizer(None, str(tmp_path))


def _run(code: str) -> str:
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_router_app_imports_without_torch():
    _run("import kvmesh.router.app, sys; assert 'torch' not in sys.modules")


def test_api_protocol_and_input_processor_import_without_torch():
    _run("import kvmesh.api.protocol, kvmesh.engine.input_processor, sys; "
         "assert 'torch' not in sys.modules")


def test_router_tokenizes_like_the_engine_without_weights_or_torch(smollm_tokenizer_dir):
    # the router's whole path from the built-in model's name to token ids, in a fresh process
    # with a warm tokenizer cache (the fixture): nothing of the model code, no torch.
    code = (
        "import json, sys\n"
        "from kvmesh.prompt.sources import load_tokenizer\n"
        "from kvmesh.router.prompt import prompt_token_ids\n"
        "tok = load_tokenizer('SmolLM2-135M-Instruct')\n"
        "ids = prompt_token_ids(tok, 'chat', {'messages': [{'role': 'developer', 'content': "
        "[{'type': 'text', 'text': 'Be brief.'}]}, {'role': 'user', 'content': 'Hi'}]})\n"
        "loaded = sorted(m for m in sys.modules if m == 'torch' or m.startswith('kvmesh.engine'))\n"
        "print(json.dumps({'ids': ids, 'loaded': loaded}))\n")
    out = json.loads(_run(code))
    assert out["loaded"] == []
    assert out["ids"] == [1, 9690, 198, 6077, 5453, 30, 2, 198, 1, 4093, 198, 26843, 2, 198, 1,
                          520, 9531, 198]
