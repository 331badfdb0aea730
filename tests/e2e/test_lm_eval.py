"""lm-evaluation-harness itself against the real server: its `local-completions` model sends
echo + logprobs + max_tokens 1 requests (token ids) for a log-likelihood task defined here from
a local JSON file (no download), and its per-sample log-likelihoods equal transformers'.

The combination that works offline: `tokenizer_backend=huggingface` with `tokenizer` set to the
built-in model's converted tokenizer directory (the one `kvmesh.prompt` caches), so lm-eval
tokenizes exactly as the server does; HF_HUB_OFFLINE / HF_DATASETS_OFFLINE keep `datasets` from
the network, and `include_defaults=False` keeps lm-eval from indexing its thousands of tasks.
"""
from __future__ import annotations

import json

import pytest
import torch

from .conftest import API_KEY

MODEL = "SmolLM2-135M-Instruct"
DOCS = [
    {"context": "The capital of France is", "continuation": " Paris"},
    {"context": "One, two, three,", "continuation": " four, five"},
    {"context": "The sky is", "continuation": " blue."},
    {"context": "def add(a, b):\n   ", "continuation": " return a + b"},
]
TASK = """\
task: kvmesh_loglikelihood
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: loglikelihood
doc_to_text: "{{{{context}}}}"
doc_to_target: "{{{{continuation}}}}"
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
"""


@pytest.fixture
def task_dir(tmp_path):
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps(d) + "\n" for d in DOCS))
    (tmp_path / "kvmesh_loglikelihood.yaml").write_text(TASK.format(data=data))
    return tmp_path


def hf_loglikelihood(model, tokenizer, context: str, continuation: str) -> tuple[float, bool]:
    """lm-eval's split (trailing whitespace of the context moves to the continuation; context
    ids, then the rest of the whole string's ids) scored by transformers: the continuation's
    summed log-prob and whether each of its tokens is the argmax."""
    spaces = len(context) - len(context.rstrip())
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    whole = tokenizer.encode(context + continuation)
    ctx = tokenizer.encode(context)
    cont = whole[len(ctx):]
    with torch.no_grad():
        lp = torch.log_softmax(model(input_ids=torch.tensor([whole])).logits[0].float(), -1)
    rows = lp[len(ctx) - 1:len(whole) - 1]
    picked = rows[torch.arange(len(cont)), torch.tensor(cont)]
    return float(picked.sum()), bool((rows.argmax(-1) == torch.tensor(cont)).all())


def test_lm_eval_local_completions_loglikelihoods_equal_transformers(
        server, task_dir, hf_smollm, monkeypatch):
    from kvmesh.common.model_files import builtin_model_path
    from kvmesh.prompt.sources import gguf_tokenizer_dir, load_tokenizer
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    monkeypatch.setenv("OPENAI_API_KEY", API_KEY)         # lm-eval's Bearer token
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    tokenizer_dir = gguf_tokenizer_dir(builtin_model_path())
    results = simple_evaluate(
        model="local-completions",
        model_args={"model": MODEL, "base_url": f"{server.url}/v1/completions",
                    "tokenizer_backend": "huggingface", "tokenizer": str(tokenizer_dir),
                    "num_concurrent": 1, "max_retries": 1},
        tasks=["kvmesh_loglikelihood"], batch_size=2, log_samples=True,
        task_manager=TaskManager(include_path=str(task_dir), include_defaults=False))
    samples = sorted(results["samples"]["kvmesh_loglikelihood"], key=lambda s: s["doc_id"])
    assert len(samples) == len(DOCS)
    tok = load_tokenizer(None)
    greedy = []
    for sample, doc in zip(samples, DOCS):
        assert sample["doc"] == doc
        (loglik, is_greedy), = sample["filtered_resps"]
        want, want_greedy = hf_loglikelihood(hf_smollm, tok, doc["context"], doc["continuation"])
        assert abs(loglik - want) < 1e-4, (doc, loglik, want)
        assert is_greedy == want_greedy
        greedy.append(want_greedy)
    acc = results["results"]["kvmesh_loglikelihood"]["acc,none"]
    assert acc == pytest.approx(sum(greedy) / len(greedy))
