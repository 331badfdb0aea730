"""Tools in the one prompt renderer: the template's own `tools=` when it knows tools, the default
Hermes-style rendering when it does not, and the router rendering a raw body exactly as the API
server renders its request."""
from __future__ import annotations

import json

import pytest
from kvmesh.prompt.tokenizer import Tokenizer
from kvmesh.prompt.tools import tools_section, with_default_tools

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather now",
                                           "parameters": {"type": "object", "properties": {
                                               "city": {"type": "string"}}}}}]
HISTORY = [{"role": "user", "content": "Weather in Paris?"},
           {"role": "assistant", "content": None, "tool_calls": [
               {"id": "c1", "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
           {"role": "tool", "tool_call_id": "c1", "content": "22C"}]


@pytest.fixture(scope="module")
def tokenizer(smollm_tokenizer_dir):
    return Tokenizer.from_dir(smollm_tokenizer_dir)


def test_the_default_rendering_exactly():
    out = with_default_tools([{"role": "system", "content": "Be brief."}, *HISTORY[1:]], TOOLS,
                             inline_tools=True, inline_calls=True)
    assert out == [
        {"role": "system", "content": "Be brief.\n\n" + tools_section(TOOLS)},
        {"role": "assistant", "content": '<tool_call>\n{"name": "get_weather", "arguments": '
                                         '"{\\"city\\": \\"Paris\\"}"}\n</tool_call>'},
        {"role": "tool", "content": "<tool_response>\n22C\n</tool_response>"}]
    assert tools_section(TOOLS).startswith("# Tools\n\n")
    assert "<tools>\n" + json.dumps(TOOLS[0]) + "\n</tools>" in tools_section(TOOLS)


def test_chatml_without_tools_gets_the_default_rendering(tokenizer):
    text = tokenizer.render_chat(HISTORY, tools=TOOLS)
    assert text.startswith("<|im_start|>system\n# Tools\n\n")
    assert ('<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": '
            '{"city": "Paris"}}\n</tool_call><|im_end|>\n') in text      # arguments as an object
    assert "<|im_start|>tool\n<tool_response>\n22C\n</tool_response><|im_end|>\n" in text
    assert text.endswith("<|im_start|>assistant\n")
    # without tools, the calls in the history are still shown; no tools section
    assert "# Tools" not in tokenizer.render_chat(HISTORY)
    assert "<tool_call>" in tokenizer.render_chat(HISTORY)


def test_a_template_that_knows_tools_renders_them_itself(tokenizer):
    template = ("{% for t in tools %}[T:{{ t.function.name }}]{% endfor %}"
                "{% for m in messages %}<{{ m.role }}>{{ m.content }}"
                "{% for c in m.tool_calls or [] %}[C:{{ c.function.name }} "
                "{{ c.function.arguments | tojson }}]{% endfor %}{% endfor %}")
    tok = Tokenizer(tokenizer.hf.__class__(tokenizer_object=tokenizer.hf.backend_tokenizer,
                                           chat_template=template))
    assert tok.render_chat(HISTORY, add_generation_prompt=False, tools=TOOLS) == (
        '[T:get_weather]<user>Weather in Paris?<assistant>[C:get_weather {"city": "Paris"}]'
        "<tool>22C")


def test_the_router_renders_a_raw_body_as_the_api_server_renders_its_request(tokenizer):
    from kvmesh.api.protocol import ChatCompletionRequest
    from kvmesh.api.serving_chat import apply_template
    from kvmesh.router.prompt import prompt_token_ids
    body = {"model": "m", "messages": [*HISTORY, {"role": "user", "content": "And Rome?",
                                                  "name": None}],
            "tools": TOOLS, "tool_choice": "auto"}
    req = ChatCompletionRequest.model_validate(body)
    engine_ids = apply_template(tokenizer, req.messages, True, req.tools)
    assert prompt_token_ids(tokenizer, "chat", json.loads(json.dumps(body))) == engine_ids
    without_tools = apply_template(tokenizer, req.messages, True, None)
    assert engine_ids != without_tools and len(engine_ids) > len(without_tools) + 50
