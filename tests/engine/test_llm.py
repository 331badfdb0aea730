"""The offline LLM API on the built-in SmolLM2: chat, per-prompt SamplingParams, logprobs."""
from __future__ import annotations

import pytest

from kvmesh.engine.llm import LLM
from kvmesh.engine.sampling_params import SamplingParams

GREEDY = SamplingParams(max_tokens=4, temperature=0.0)
CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "Hi!"}],
]


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(dtype="float32", device="cpu", num_kv_blocks=64)


def test_chat_equals_generate_on_the_chat_templated_prompt(llm):
    chats = llm.chat(CONVERSATIONS, GREEDY)
    templated = [llm.tokenizer.apply_chat_template(c, add_generation_prompt=True)
                 for c in CONVERSATIONS]
    plain = llm.generate(templated, GREEDY)
    assert [o.prompt_token_ids for o in chats] == [o.prompt_token_ids for o in plain]
    assert [o.outputs[0].token_ids for o in chats] == [o.outputs[0].token_ids for o in plain]
    assert [len(o.outputs[0].token_ids) for o in chats] == [4, 4]
    hf = llm.tokenizer.hf
    first = hf.decode(chats[0].prompt_token_ids)
    assert first.endswith("<|im_start|>user\nWhat is the capital of France?<|im_end|>\n"
                          "<|im_start|>assistant\n")
    single = llm.chat(CONVERSATIONS[0], GREEDY)          # one conversation, not a list of them
    assert single[0].outputs[0].token_ids == chats[0].outputs[0].token_ids


def test_a_list_of_sampling_params_applies_per_prompt(llm):
    prompts = ["The capital of France is", "Water boils at", "1, 2, 3,"]
    params = [SamplingParams(max_tokens=2, temperature=0.0),
              SamplingParams(max_tokens=5, temperature=0.0, logprobs=1),
              SamplingParams(max_tokens=3, temperature=1.0, seed=7)]
    batched = llm.generate(prompts, params)
    alone = [llm.generate(p, sp)[0] for p, sp in zip(prompts, params)]
    assert [len(o.outputs[0].token_ids) for o in batched] == [2, 5, 3]
    assert [o.outputs[0].token_ids for o in batched] == [o.outputs[0].token_ids for o in alone]
    assert [o.outputs[0].logprobs is None for o in batched] == [True, False, True]
    assert [o.outputs[0].finish_reason for o in batched] == ["length"] * 3
    with pytest.raises(ValueError, match="got 2 sampling params for 3 prompts"):
        llm.generate(prompts, params[:2])


@pytest.mark.parametrize("k", [0, 3])
def test_greedy_logprobs_have_k_entries_and_the_sampled_token_is_the_max(llm, k):
    out = llm.generate("The capital of France is",
                       SamplingParams(max_tokens=3, temperature=0.0, logprobs=k))[0].outputs[0]
    assert len(out.logprobs) == 3
    for token, step in zip(out.token_ids, out.logprobs):
        # greedy: the sampled token is the top-1, so it is one of the k (or alone with k = 0)
        assert len(step) == max(k, 1)
        assert step[token].rank == 1
        assert step[token].logprob == max(lp.logprob for lp in step.values())
        assert sorted(lp.rank for lp in step.values()) == list(range(1, max(k, 1) + 1))
    assert out.cumulative_logprob < 0


def test_vllm_prompt_dicts_equal_text_and_token_id_prompts(llm):
    """vLLM's TextPrompt / TokensPrompt dicts, alone or in a list, as the plain prompts."""
    text = "The capital of France is"
    ids = llm.tokenizer.encode(text)
    plain = [o.outputs[0].token_ids for o in llm.generate([text, ids], GREEDY)]
    dicts = llm.generate([{"prompt": text}, {"prompt_token_ids": ids}], GREEDY)
    assert [o.outputs[0].token_ids for o in dicts] == plain
    assert dicts[0].prompt == text and dicts[1].prompt_token_ids == ids
    assert llm.generate({"prompt_token_ids": ids}, GREEDY)[0].outputs[0].token_ids == plain[1]


@pytest.mark.parametrize("prompt,match", [
    ({"prompt": "a", "prompt_token_ids": [1]}, r"exactly one of .* got \['prompt', 'prompt_token_ids'\]"),
    ({}, "exactly one of .* got neither"),
    ({"prompt": "a", "multi_modal_data": {}}, r"unsupported prompt key\(s\) \['multi_modal_data'\]"),
    ({"prompt": [1, 2]}, "'prompt' must be a string, got list"),
    ({"prompt_token_ids": "12"}, "'prompt_token_ids' must be a list of token ids, got a string"),
    ({"prompt_token_ids": [1, 10 ** 9]}, r"prompt token id 1000000000 is outside the vocabulary"),
])
def test_a_bad_prompt_dict_is_refused_and_nothing_runs(llm, prompt, match):
    with pytest.raises(ValueError, match=match):
        llm.generate(["fine", prompt], GREEDY)
    assert not llm.engine.has_unfinished_requests()

