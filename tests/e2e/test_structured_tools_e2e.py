"""Structured outputs and tool calling through a real `kvmesh serve` with the official openai
client over a real socket (issue 15): `chat.completions.parse` with a Pydantic model,
`openai.pydantic_function_tool` with tool_choice named / required, streaming (the client's
stream helpers assemble the tool-call deltas) and not, every vLLM constraint field, the 400s."""
from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
from pydantic import BaseModel, Field
from servers import start_server

MODEL = "SmolLM2-135M-Instruct"


class City(BaseModel):
    name: str = Field(max_length=12)
    population: int = Field(ge=0, le=10_000_000)
    coastal: bool


class GetWeather(BaseModel):
    """Current weather in a city."""
    city: str = Field(max_length=12)
    unit: str = Field(pattern="^(celsius|fahrenheit)$")


class Add(BaseModel):
    """Add two integers."""
    a: int = Field(ge=0, le=100)
    b: int = Field(ge=0, le=100)


ASK_WEATHER = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = start_server(tmp_path_factory.mktemp("structured"), "--num-kv-blocks", "256",
                       "--max-num-seqs", "16", "--max-model-len", "1024", "--log-level", "warning",
                       env={"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"})
    yield srv
    assert srv.stop() == 0, srv.log()[-3000:]


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0, timeout=120)


def test_parse_with_a_pydantic_model(client):
    completion = client.chat.completions.parse(
        model=MODEL, messages=[{"role": "user", "content": "Describe a city as JSON."}],
        response_format=City, temperature=1.0, max_tokens=80, seed=3)
    choice = completion.choices[0]
    assert choice.finish_reason == "stop"
    city = choice.message.parsed
    assert isinstance(city, City) and 0 <= city.population <= 10_000_000
    assert City.model_validate_json(choice.message.content) == city


def test_named_function_is_called_with_valid_arguments(client):
    tools = [openai.pydantic_function_tool(GetWeather), openai.pydantic_function_tool(Add)]
    completion = client.chat.completions.parse(
        model=MODEL, messages=ASK_WEATHER, tools=tools, temperature=1.0, max_tokens=80, seed=5,
        tool_choice={"type": "function", "function": {"name": "GetWeather"}})
    choice = completion.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.function.name == "GetWeather" and call.id.startswith("call_")
    assert isinstance(call.function.parsed_arguments, GetWeather)


def test_required_streams_deltas_the_stream_helper_assembles(client):
    tools = [openai.pydantic_function_tool(GetWeather), openai.pydantic_function_tool(Add)]
    with client.chat.completions.stream(
            model=MODEL, messages=[{"role": "user", "content": "Add 2 and 3."}], tools=tools,
            tool_choice="required", temperature=1.0, max_tokens=80, seed=7) as stream:
        events = list(stream)
        final = stream.get_final_completion()
    choice = final.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    model = {"GetWeather": GetWeather, "Add": Add}[call.function.name]
    assert isinstance(call.function.parsed_arguments, model)
    # the arguments came in several pieces; name and id once
    arg_deltas = [e for e in events if e.type == "tool_calls.function.arguments.delta"]
    assert len(arg_deltas) > 1
    assert "".join(e.arguments_delta for e in arg_deltas) == call.function.arguments


def test_auto_parses_what_the_model_writes(client):
    tools = [openai.pydantic_function_tool(GetWeather)]
    completion = client.chat.completions.create(
        model=MODEL, messages=ASK_WEATHER, tools=tools, tool_choice="auto", temperature=0,
        max_tokens=60)
    choice = completion.choices[0]
    # whatever the small model writes, the answer is a consistent OpenAI message
    if choice.message.tool_calls:
        assert choice.finish_reason == "tool_calls"
        for call in choice.message.tool_calls:
            json.loads(call.function.arguments)
    else:
        assert choice.message.content and choice.finish_reason in ("stop", "length")


def test_tool_history_renders_and_none_answers_in_text(client):
    messages = [*ASK_WEATHER,
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "call_1", "type": "function",
                     "function": {"name": "GetWeather",
                                  "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "22 degrees, sunny"}]
    completion = client.chat.completions.create(
        model=MODEL, messages=messages, tools=[openai.pydantic_function_tool(GetWeather)],
        tool_choice="none", temperature=0, max_tokens=8)
    choice = completion.choices[0]
    assert choice.message.tool_calls is None and choice.message.content
    assert completion.usage.prompt_tokens > 150          # the tools section and the history


CONSTRAINTS = [
    ({"structured_outputs": {"choice": ["red", "green"]}}, lambda t: t in ("red", "green")),
    ({"guided_choice": ["yes", "no"]}, lambda t: t in ("yes", "no")),
    ({"structured_outputs": {"regex": "[0-9]{3}-[a-z]{2}"}},
     lambda t: re.fullmatch("[0-9]{3}-[a-z]{2}", t)),
    ({"guided_regex": "(cat|dog)s?"}, lambda t: re.fullmatch("(cat|dog)s?", t)),
    ({"structured_outputs": {"grammar": 'root ::= "x" [0-9] [0-9]'}},
     lambda t: re.fullmatch("x[0-9][0-9]", t)),
    ({"guided_grammar": 'root ::= ("a" | "b"){1,5} "."'}, lambda t: re.fullmatch("[ab]+[.]", t)),
    # NOTE: any object: unbounded, so greedy (the sampled model may write keys past max_tokens)
    ({"response_format": {"type": "json_object"}, "temperature": 0, "_prompt": "Answer in JSON:"},
     lambda t: isinstance(json.loads(t), dict)),
    ({"structured_outputs": {"json_object": True}, "temperature": 0,
      "_prompt": "Answer in JSON:"},
     lambda t: isinstance(json.loads(t), dict)),
    # NOTE: an integer is unbounded too: sampled, the model may write digits past max_tokens
    ({"guided_json": {"type": "object", "properties": {"n": {"type": "integer"}},
                      "required": ["n"]}, "temperature": 0},
     lambda t: isinstance(json.loads(t)["n"], int)),
]


def test_every_constraint_field_on_completions_and_chat(server):
    """All at once (the server batches them): each field on both endpoints."""
    def ask(args):
        path, body = args
        return httpx.post(f"{server.url}/v1/{path}", json={"temperature": 1.0, "seed": 1, **body},
                          timeout=300)

    cases = []
    for extra, check in CONSTRAINTS:
        extra = dict(extra)
        prompt = extra.pop("_prompt", "Answer:")
        cases.append(("completions", {"prompt": prompt, "max_tokens": 40, **extra}, check))
        cases.append(("chat/completions", {"messages": [{"role": "user", "content": "Answer."}],
                                           "max_tokens": 40, **extra}, check))
    with ThreadPoolExecutor(len(cases)) as pool:
        answers = list(pool.map(ask, [(path, body) for path, body, _ in cases]))
    for (path, body, check), r in zip(cases, answers):
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        text = choice["text"] if path == "completions" else choice["message"]["content"]
        assert choice["finish_reason"] == "stop" and check(text), (path, body, text)


def test_streaming_finishes_with_stop_when_the_grammar_completes_and_length_otherwise(client):
    schema = {"type": "object", "properties": {"word": {"type": "string", "maxLength": 200}},
              "required": ["word"]}
    for max_tokens, reason in ((60, None), (3, "length")):
        stream = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "A word as JSON."}],
            response_format={"type": "json_schema",
                             "json_schema": {"name": "w", "schema": schema, "strict": True}},
            max_tokens=max_tokens, temperature=1.0, seed=2, stream=True)
        chunks = list(stream)
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        finish = [c.choices[0].finish_reason for c in chunks if c.choices and
                  c.choices[0].finish_reason]
        if reason == "length":
            assert finish == ["length"]
        elif finish == ["stop"]:
            assert isinstance(json.loads(text)["word"], str)
        else:                      # the small model may write a long word: then it is cut
            assert finish == ["length"]


@pytest.mark.parametrize("body, param, words", [
    ({"response_format": {"type": "json_object"}, "guided_regex": "a+"}, "guided_regex",
     "at most one"),
    ({"structured_outputs": {"regex": "(ab"}}, "structured_outputs.regex", "regex"),
    ({"structured_outputs": {"grammar": "root ::= missing"}}, "structured_outputs.grammar",
     "missing"),
    ({"guided_json": {"type": "array", "uniqueItems": True}}, "guided_json", "uniqueItems"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"a": {"not": {"type": "string"}}}}}}},
     "response_format", "'not'"),
    ({"structured_outputs": {}}, "structured_outputs", "one of"),
    ({"guided_choice": []}, "guided_choice", "non-empty"),
    ({"guided_regex": "a+", "ignore_eos": True}, "ignore_eos", "ignore_eos"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}],
      "tool_choice": {"type": "function", "function": {"name": "g"}}}, None, "not in tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"type": "number", "multipleOf": 0.5}}}}}],
      "tool_choice": "required"}, "tools", "multipleOf"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "required",
      "response_format": {"type": "json_object"}}, "response_format", "cannot be combined"),
])
def test_bad_constraints_are_400s_naming_the_problem(server, body, param, words):
    r = httpx.post(f"{server.url}/v1/chat/completions",
                   json={"messages": [{"role": "user", "content": "x"}], "max_tokens": 4, **body},
                   timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert words in err["message"], err
    if param is not None:
        assert err["param"] == param, err
    assert httpx.get(f"{server.url}/health").status_code == 200


def test_openapi_documents_the_new_fields(server):
    doc = httpx.get(f"{server.url}/openapi.json", timeout=30).json()
    schemas = doc["components"]["schemas"]
    chat = schemas["ChatCompletionRequest"]["properties"]
    for name in ("CompletionRequest", "ChatCompletionRequest"):
        props = schemas[name]["properties"]
        assert {"response_format", "structured_outputs", "guided_json", "guided_regex",
                "guided_choice", "guided_grammar"} <= props.keys()
        assert "at most one output constraint" in schemas[name]["description"]
    assert schemas["ResponseFormat"]["properties"]["type"]["enum"] == \
        ["text", "json_object", "json_schema"]
    assert set(schemas["StructuredOutputsParams"]["properties"]) == \
        {"json", "regex", "choice", "grammar", "json_object"}
    assert chat["tool_choice"]["anyOf"][0]["enum"] == ["none", "auto", "required"]
    assert chat["tools"]["anyOf"][0]["items"]["properties"]["function"]["required"] == ["name"]
    assert {"tool_calls", "tool_call_id"} <= schemas["ChatMessage"]["properties"].keys()
