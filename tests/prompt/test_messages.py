"""One message normalisation for the API, the offline LLM and the router; the template gets
tools and documents."""
from __future__ import annotations

import json
import shutil

import pytest

from kvmesh.api.protocol import ChatMessage
from kvmesh.prompt.messages import normalise_message, normalise_messages
from kvmesh.prompt.tokenizer import Tokenizer


def test_normalise_message_exact():
    assert normalise_message({"role": "developer", "content": [{"type": "text", "text": "a"},
                                                               {"type": "text", "text": "b"}]}) \
        == {"role": "system", "content": "a\nb"}
    assert normalise_message({"role": "assistant", "content": None, "name": "bot"}) \
        == {"role": "assistant", "content": "", "name": "bot"}
    assert normalise_message({"role": "user", "name": ""}) == {"role": "user", "content": ""}
    # keys a template may use (tool calls) pass through, after role / content / name; a call's
    # arguments JSON text becomes the object templates write with `tojson`; null keys are dropped
    call = [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"a": [1]}'}}]
    assert list(normalise_message({"tool_calls": call, "role": "assistant",
                                   "tool_call_id": None}).items()) \
        == [("role", "assistant"), ("content", ""),
            ("tool_calls", [{"id": "c1", "type": "function",
                             "function": {"name": "f", "arguments": {"a": [1]}}}])]
    assert call[0]["function"]["arguments"] == '{"a": [1]}'          # the input is not changed
    # arguments that are not JSON are left to the template as they are
    bad = [{"id": "c2", "type": "function", "function": {"name": "f", "arguments": "{oops"}}]
    assert normalise_message({"role": "assistant", "tool_calls": bad})["tool_calls"] == bad


def test_normalise_is_idempotent_and_does_not_mutate():
    raw = {"role": "developer", "content": [{"type": "text", "text": "x"}], "name": "n"}
    once = normalise_message(raw)
    assert normalise_message(once) == once
    assert raw == {"role": "developer", "content": [{"type": "text", "text": "x"}], "name": "n"}


@pytest.mark.parametrize("message, error", [
    ({"role": "user", "content": [{"type": "image_url", "image_url": {}}]},
     "unsupported message content part 'image_url'; only 'text' parts are supported"),
    ({"role": "user", "content": ["text"]}, "unsupported message content part 'str'"),
    ("hello", "a chat message must be an object, got str"),
])
def test_unsupported_messages_are_value_errors(message, error):
    with pytest.raises(ValueError, match=error):
        normalise_message(message)


def test_api_messages_normalise_like_raw_json():
    # what the API server hands the tokenizer equals the router's view of the same JSON body
    body = [{"role": "developer", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
            {"role": "assistant", "content": None, "name": "bot"}, {"role": "user", "content": "hi"}]
    api = [ChatMessage.model_validate(m).model_dump(exclude_none=True) for m in body]
    assert normalise_messages(api) == normalise_messages(body) == [
        {"role": "system", "content": "a\nb"}, {"role": "assistant", "content": "", "name": "bot"},
        {"role": "user", "content": "hi"}]


def test_tools_and_documents_reach_the_template(tmp_path, smollm_tokenizer_dir):
    shutil.copy(smollm_tokenizer_dir / "tokenizer.json", tmp_path / "tokenizer.json")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": (
        "{% for t in tools or [] %}<tool {{ t['function']['name'] }}>{% endfor %}"
        "{% for d in documents or [] %}<doc {{ d['title'] }}>{% endfor %}"
        "{% for m in messages %}[{{ m['role'] }}:{{ m['content'] }}]{% endfor %}"
        "{% if add_generation_prompt %}>{% endif %}")}))
    tok = Tokenizer.from_dir(tmp_path)
    messages = [{"role": "developer", "content": "s"}, {"role": "user", "content": "q"}]
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {}}}]
    documents = [{"title": "manual", "text": "..."}]
    assert tok.render_chat(messages, tools=tools, documents=documents) \
        == "<tool get_weather><doc manual>[system:s][user:q]>"
    assert tok.render_chat(messages, add_generation_prompt=False) == "[system:s][user:q]"
    assert tok.apply_chat_template(messages, tools=tools) \
        == tok.encode("<tool get_weather>[system:s][user:q]>", add_special_tokens=False)
