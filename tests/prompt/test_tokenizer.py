"""Tokenizer: round trips, ChatML ids equal to transformers', content parts, eos ids, errors."""
from __future__ import annotations

import json
import shutil

import pytest

from kvmesh.prompt.tokenizer import Tokenizer

CHATML = ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
          "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n")


@pytest.fixture(scope="session")
def hf_gguf_tokenizer(builtin_path):
    """transformers' own tokenizer converted from the GGUF (the reference; ~5 s)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(builtin_path.parent), gguf_file=builtin_path.name)


@pytest.fixture(scope="session")
def tok(smollm):
    return smollm.tokenizer


@pytest.mark.parametrize("text", ["Hello world", "  leading spaces and\ttabs\n\nnewlines", "Ünïcödé 😀 中文",
                                  "<|im_start|>user\nhi<|im_end|>", ""])
def test_round_trip_and_same_ids_as_transformers(tok, hf_gguf_tokenizer, text):
    ids = tok.encode(text)
    assert ids == hf_gguf_tokenizer.encode(text)
    assert tok.decode(ids) == text
    assert tok.convert_ids_to_tokens(ids) == hf_gguf_tokenizer.convert_ids_to_tokens(ids)


def test_special_tokens(tok):
    assert tok.encode("<|im_start|>") == [1]       # special tokens are single ids
    assert tok.decode([1, 2], skip_special_tokens=True) == ""
    assert set(tok.all_special_ids) >= {0, 1, 2}
    assert (tok.bos_token_id, tok.eos_token_id, tok.eos_token_ids) == (1, 2, (2,))
    assert tok.vocab_size == 49152


def test_chat_template_matches_transformers(tok, hf_gguf_tokenizer):
    messages = [{"role": "user", "content": "Hi there"}]
    assert tok.render_chat(messages) == CHATML
    ids = tok.apply_chat_template(messages)
    ref = hf_gguf_tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    ref = ref["input_ids"] if hasattr(ref, "keys") else ref  # transformers 5 returns a BatchEncoding
    assert ids == list(ref)
    prompt = tok.encode("<|im_start|>assistant\n")
    assert ids[0] == 1 and ids[-len(prompt):] == prompt
    assert tok.apply_chat_template(messages, add_generation_prompt=False) == ids[:-len(prompt)]


def test_content_parts_equal_plain_string(tok):
    plain = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "a\nb"}]
    parts = [{"role": "system", "content": [{"type": "text", "text": "Be brief."}]},
             {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]
    assert tok.apply_chat_template(parts) == tok.apply_chat_template(plain)
    with pytest.raises(ValueError, match="unsupported message content part 'image_url'"):
        tok.apply_chat_template([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}])


def test_missing_chat_template_is_a_clear_error(tmp_path, smollm_tokenizer_dir):
    shutil.copy(smollm_tokenizer_dir / "tokenizer.json", tmp_path / "tokenizer.json")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))
    plain = Tokenizer.from_dir(tmp_path, extra_eos_token_ids=(2, 0))
    assert plain.eos_token_ids == (0, 2)              # the tokenizer's own eos first, then extras
    assert plain.encode("Hello world") == [19556, 905]
    with pytest.raises(ValueError, match="no chat template"):
        plain.apply_chat_template([{"role": "user", "content": "hi"}])


def test_chat_template_jinja_file_and_named_templates(tmp_path, smollm_tokenizer_dir):
    shutil.copy(smollm_tokenizer_dir / "tokenizer.json", tmp_path / "tokenizer.json")
    (tmp_path / "chat_template.jinja").write_text("{% for m in messages %}[{{ m['content'] }}]{% endfor %}")
    assert Tokenizer.from_dir(tmp_path).render_chat([{"role": "user", "content": "x"}]) == "[x]"
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": [
        {"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}]}))
    assert Tokenizer.from_dir(tmp_path).render_chat([{"role": "user", "content": "x"}]) == "D"


def test_missing_or_malformed_tokenizer_files(tmp_path):
    with pytest.raises(FileNotFoundError, match="missing tokenizer.json"):
        Tokenizer.from_dir(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(ValueError, match="cannot load tokenizer"):
        Tokenizer.from_dir(tmp_path)
