"""Tool-call parsers on exact strings: whole outputs and streamed deltas (OpenAI's shape: index,
id, type and name once, the arguments in pieces that join to the whole output's string)."""
from __future__ import annotations

import json

import pytest
from kvmesh.api.tool_parsers import (
    HermesToolParser,
    Llama3JsonToolParser,
    MistralToolParser,
    ToolStream,
    get_tool_parser,
    parser_for_template,
)
from kvmesh.api.tool_parsers.json_scan import object_spans

HERMES = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", '
          '"opts": {"unit": "c}"}}}\n</tool_call>\n<tool_call>\n{"name": "now", "arguments": {}}'
          '\n</tool_call>')
LLAMA = '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Oslo"}}; {"name": "now", "parameters": {}}'
MISTRAL = 'Sure[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Rome"}}, {"name": "now", "arguments": {}}]'


def calls(found):
    return [(c.name, c.arguments) for c in found.calls]


def test_hermes_extract():
    found = HermesToolParser().extract(HERMES)
    assert found.content == "Let me check.\n"
    assert calls(found) == [("get_weather", '{"city": "Paris", "opts": {"unit": "c}"}}'),
                            ("now", "{}")]
    assert all(c.id.startswith("call_") and len(c.id) == 29 for c in found.calls)
    assert len({c.id for c in found.calls}) == 2


def test_llama3_json_extract():
    found = Llama3JsonToolParser().extract(LLAMA)
    assert found.content is None
    assert calls(found) == [("get_weather", '{"city": "Oslo"}'), ("now", "{}")]
    assert calls(Llama3JsonToolParser().extract(' {"name": "f", "arguments": {"a": 1}}')) == \
        [("f", '{"a": 1}')]


def test_mistral_extract():
    found = MistralToolParser().extract(MISTRAL)
    assert found.content == "Sure"
    assert calls(found) == [("get_weather", '{"city": "Rome"}'), ("now", "{}")]
    assert MistralToolParser.needs_special_tokens


@pytest.mark.parametrize("parser, text", [
    (HermesToolParser(), "no tools here"),
    (HermesToolParser(), '<tool_call>\n{"name": "f", "arguments": {"a": }\n</tool_call>'),
    (HermesToolParser(), '<tool_call>\n{"arguments": {}}\n</tool_call>'),       # no name
    (HermesToolParser(), '<tool_call>\n{"name": "f", "arguments": {"a": 1'),    # cut short
    (Llama3JsonToolParser(), 'Hello {"name": "f"}'),
    (Llama3JsonToolParser(), '{"not": "a call"}'),
    (MistralToolParser(), "[TOOL_CALLS][oops]"),
])
def test_anything_that_is_not_a_whole_call_stays_content(parser, text):
    found = parser.extract(text)
    assert found.content == text and found.calls == []


def stream(parser, text: str, size: int):
    s = ToolStream(parser)
    deltas = []
    for i in range(0, len(text), size):
        deltas += s.feed(text[i:i + size])
    deltas += s.feed("", final=True)
    return s, deltas


def assemble(deltas):
    content, calls_ = "", {}
    for d in deltas:
        content += d.get("content", "")
        for tc in d.get("tool_calls", []):
            call = calls_.setdefault(tc["index"], {"id": None, "name": None, "arguments": ""})
            if "id" in tc:
                assert call["id"] is None, "id sent twice"
                call["id"] = tc["id"]
                assert tc["type"] == "function"
            if "name" in tc["function"]:
                assert call["name"] is None, "name sent twice"
                call["name"] = tc["function"]["name"]
            call["arguments"] += tc["function"].get("arguments", "")
    return content, [calls_[i] for i in sorted(calls_)]


@pytest.mark.parametrize("size", [1, 2, 7, 1000])
@pytest.mark.parametrize("parser, text", [(HermesToolParser(), HERMES),
                                          (Llama3JsonToolParser(), LLAMA),
                                          (MistralToolParser(), MISTRAL)])
def test_streamed_deltas_join_to_the_whole_output(parser, text, size):
    s, deltas = stream(parser, text, size)
    content, streamed = assemble(deltas)
    whole = parser.extract(text)
    assert content == (whole.content or "")
    assert [(c["name"], c["arguments"]) for c in streamed] == calls(whole)
    assert all(c["id"].startswith("call_") for c in streamed) and s.has_calls
    if size == 1:   # arguments really come in pieces
        assert sum(1 for d in deltas for tc in d.get("tool_calls", [])
                   if tc["function"].get("arguments")) > 10


def test_hermes_streaming_exact_deltas():
    text = 'Hi<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>'
    s = ToolStream(HermesToolParser())
    assert s.feed("Hi<tool") == [{"content": "Hi"}]            # "<tool" may start a marker
    assert s.feed('_call>\n{"name": "f", ') == [
        {"tool_calls": [{"index": 0, "id": s.calls[0].id, "type": "function",
                         "function": {"name": "f", "arguments": ""}}]}]
    assert s.feed('"arguments": {"a"') == [
        {"tool_calls": [{"index": 0, "function": {"arguments": '{"a"'}}]}]
    assert s.feed(': 1}}\n</tool_call>') == [
        {"tool_calls": [{"index": 0, "function": {"arguments": ": 1}"}}]}]
    assert s.feed("", final=True) == []
    assert s.text == text


def test_a_held_back_partial_marker_is_content_when_the_output_ends():
    s = ToolStream(HermesToolParser())
    assert s.feed("a <tool_") == [{"content": "a "}]
    assert s.feed("", final=True) == [{"content": "<tool_"}]
    assert not s.has_calls
    s = ToolStream(Llama3JsonToolParser())
    assert s.feed("  ") == []                     # maybe a call: nothing shown yet
    assert s.feed("Hello") == [{"content": "  Hello"}]


@pytest.mark.parametrize("template, parser", [
    (None, HermesToolParser),
    ("{{ '<|im_start|>' + message['role'] }}", HermesToolParser),
    ("{% if tools %}<tool_call>{% endif %}", HermesToolParser),
    ("{{ '[AVAILABLE_TOOLS]' }}{{ '[TOOL_CALLS]' }}", MistralToolParser),
    ("{{ '<|python_tag|>' }}", Llama3JsonToolParser),
    ("{% if message.role == 'ipython' %}", Llama3JsonToolParser),
])
def test_auto_picks_the_format_the_template_teaches(template, parser):
    assert parser_for_template(template) is parser
    assert isinstance(get_tool_parser("auto", template), parser)


def test_unknown_parser_name():
    with pytest.raises(ValueError, match="unknown tool-call parser 'x'; choose one of auto, "
                                         "hermes, llama3_json, mistral"):
        get_tool_parser("x", None)


def test_object_spans_ignore_braces_in_strings_and_report_the_unterminated_last():
    text = 'x {"a": "}{"} ; {"b": [1, {"c": 2}]} [{"d": "\\"}"'
    assert object_spans(text) == [(2, 13), (16, 36), (38, None)]
    assert json.loads(text[2:13]) == {"a": "}{"}


@pytest.mark.parametrize("parser, expected", [
    (HermesToolParser(), ("tagged_json", {"begin": "<tool_call>\n", "end": "\n</tool_call>",
                                          "key": "arguments"})),
    (Llama3JsonToolParser(), ("json", {"key": "parameters"})),
    (MistralToolParser(), ("tagged_json", {"begin": "[TOOL_CALLS]", "end": "",
                                           "key": "arguments"})),
])
def test_constrained_specs_call_one_of_the_tools_with_valid_arguments(parser, expected):
    tools = [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}}},
             {"type": "function", "function": {"name": "g"}}]
    spec = parser.constrained(tools, parallel=False)
    kind, want = expected
    assert spec.kind == kind
    value = json.loads(spec.value)
    schema = value["schema"] if kind == "tagged_json" else value
    if kind == "tagged_json":
        assert (value["begin"], value["end"]) == (want["begin"], want["end"])
    if isinstance(parser, MistralToolParser):
        assert (schema["minItems"], schema["maxItems"]) == (1, 1)
        schema = schema["items"]
    key = want["key"]
    assert schema == {"anyOf": [
        {"type": "object", "properties": {"name": {"const": "f"}, key: tools[0]["function"][
            "parameters"]}, "required": ["name", key]},
        {"type": "object", "properties": {"name": {"const": "g"}, key: {
            "type": "object", "properties": {}}}, "required": ["name", key]}]}


def test_constrained_outputs_parse_back(matches):
    tools = [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}}}]
    hermes = '<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>'
    for parser, text in ((HermesToolParser(), hermes),
                         (Llama3JsonToolParser(), '{"name": "f", "parameters": {"a": 1}}'),
                         (MistralToolParser(), '[TOOL_CALLS][{"name": "f", "arguments": {"a": 1}}]')):
        assert matches(parser.constrained(tools, parallel=True), text)
        assert calls(parser.extract(text)) == [("f", '{"a": 1}')]
