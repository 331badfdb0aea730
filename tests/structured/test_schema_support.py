"""What xgrammar enforces, checked on its own matcher (a value that keeps the keyword and one
that breaks it), and what it would ignore: refused with the keyword and its place named."""
from __future__ import annotations

import json

import pytest
from kvmesh.engine.structured.grammar import parse
from kvmesh.engine.structured.schema_support import check_schema
from kvmesh.engine.structured.spec import StructuredOutputError
from kvmesh.engine.structured.spec import StructuredOutputSpec as Spec

ENFORCED = [
    ({"type": "integer", "minimum": 0, "maximum": 5}, "5", "7"),
    ({"type": "number", "exclusiveMinimum": 0}, "0.5", "0"),
    ({"type": "integer", "multipleOf": 3}, "6", "4"),
    ({"type": "string", "minLength": 3, "maxLength": 4}, '"abc"', '"ab"'),
    ({"type": "string", "pattern": "^[a-z]+$"}, '"ab"', '"AB"'),
    ({"type": "string", "format": "email"}, '"a@b.io"', '"abc"'),
    ({"type": "string", "format": "date"}, '"2026-11-23"', '"23/11/2026"'),
    ({"type": "string", "format": "uuid"}, '"123e4567-e89b-12d3-a456-426614174000"', '"x"'),
    ({"type": "array", "items": {"type": "integer"}, "minItems": 2, "maxItems": 3}, "[1, 2]", "[1]"),
    ({"type": "array", "prefixItems": [{"type": "string"}], "items": False}, '["a"]', "[1]"),
    ({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
     '{"a": 1}', "{}"),
    ({"type": "object", "properties": {"a": {"type": "integer"}}}, '{"a": 1}', '{"b": 1}'),
    ({"type": "object", "additionalProperties": {"type": "integer"}, "maxProperties": 1},
     '{"a": 1}', '{"a": 1, "b": 2}'),
    ({"enum": ["a", 1, None]}, "null", '"b"'),
    ({"const": "a"}, '"a"', '"c"'),
    ({"anyOf": [{"type": "integer"}, {"type": "string"}]}, '"x"', "true"),
    ({"allOf": [{"type": "integer", "maximum": 2}]}, "2", "3"),
    ({"$defs": {"x": {"type": "integer"}}, "type": "object",
      "properties": {"a": {"$ref": "#/$defs/x"}}}, '{"a": 1}', '{"a": "s"}'),
]


@pytest.mark.parametrize("schema, good, bad", ENFORCED)
def test_supported_keywords_are_enforced(matches, schema, good, bad):
    spec = Spec.json_schema(schema)
    check_schema(schema)
    assert matches(spec, good)
    assert not matches(spec, bad)


REFUSED = [
    ({"type": "array", "uniqueItems": True}, "'uniqueItems' is not supported at #"),
    ({"type": "array", "contains": {"type": "string"}}, "'contains' is not supported at #"),
    ({"not": {"type": "string"}}, "'not' is not supported at #"),
    ({"if": {"type": "string"}, "then": {"minLength": 2}}, "'if' is not supported at #"),
    ({"oneOf": [{"type": "integer"}, {"type": "number"}]}, "'oneOf' is not supported at #"),
    ({"allOf": [{"type": "integer"}, {"minimum": 3}]}, "'allOf' is only supported with one"),
    ({"type": "object", "patternProperties": {"^a": {}}}, "'patternProperties' is not supported"),
    ({"type": "object", "propertyNames": {"pattern": "^a"}}, "'propertyNames' is not supported"),
    ({"type": "object", "dependentRequired": {"a": ["b"]}}, "'dependentRequired' is not supported"),
    ({"type": "number", "multipleOf": 0.5},
     "'multipleOf' is only supported with \"type\": \"integer\" at #"),
    ({"type": "integer", "multipleOf": 5, "minimum": 0},
     "'multipleOf' cannot be combined with 'minimum'"),
    ({"type": "string", "pattern": "^a+$", "maxLength": 3},
     "'maxLength' cannot be combined with 'pattern'"),
    ({"type": "string", "format": "email", "minLength": 3},
     "'minLength' cannot be combined with 'format'"),
    ({"type": "string", "pattern": "(?=a)b"}, "a lookahead or lookbehind in 'pattern'"),
    ({"type": "string", "format": "regex"}, "string format 'regex' is not supported"),
    ({"type": "object", "properties": {"a": {"type": "object", "properties": {
        "b": {"type": "array", "items": {"uniqueItems": True}}}}}},
     "'uniqueItems' is not supported at #/properties/a/properties/b/items"),
    ({"$defs": {"x": {"not": {}}}, "$ref": "#/$defs/x"}, "'not' is not supported at #/$defs/x"),
    ({"anyOf": [{"type": "string"}, {"type": "integer", "multipleOf": 2, "maximum": 9}]},
     "'multipleOf' cannot be combined with 'maximum' at #/anyOf/1"),
    # not a valid schema at all (its metaschema), or one nothing can satisfy
    ({"type": "foo"}, "invalid JSON schema at #/type: 'foo' is not valid under any"),
    ({"anyOf": []}, "invalid JSON schema at #/anyOf: [] should be non-empty"),
    ({"type": "string", "minLength": -1}, "invalid JSON schema at #/minLength: -1 is less than"),
    ({"type": "object", "required": ["zz"]}, "requires 'zz', which is not in its properties"),
]


@pytest.mark.parametrize("schema, message", REFUSED)
def test_keywords_xgrammar_would_ignore_are_refused_by_name(schema, message):
    with pytest.raises(StructuredOutputError) as e:
        check_schema(schema, param="response_format")
    assert message in str(e.value) and e.value.param == "response_format"
    with pytest.raises(StructuredOutputError):          # parse checks the schema first
        parse(Spec.json_schema(schema))


def test_annotations_are_allowed():
    check_schema({"title": "T", "description": "d", "$schema": "x", "examples": [1],
                  "type": "object", "properties": {"a": {"type": "integer", "default": 1,
                                                         "deprecated": True}}})


@pytest.mark.parametrize("spec, message", [
    (Spec.regex("(ab"), "invalid structured output regex: Regex parsing error at position 4: The parenthesis is not closed."),
    (Spec.grammar("root ::= missing"), 'Rule "missing" is not defined'),
    (Spec.json_schema({"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}}),
     "invalid structured output json"),
])
def test_parse_errors_name_the_reason_without_xgrammars_source_location(spec, message):
    with pytest.raises(StructuredOutputError) as e:
        parse(spec, "guided_regex")
    assert message in str(e.value) and ".cc:" not in str(e.value)
    assert e.value.param == "guided_regex"


def test_specs_are_canonical_and_keep_property_order():
    a = Spec.json_schema('{"type": "object",  "properties": {"x": {}, "y": {}}}')
    b = Spec.json_schema({"type": "object", "properties": {"x": {}, "y": {}}})
    c = Spec.json_schema({"type": "object", "properties": {"y": {}, "x": {}}})
    assert a == b and a.key == ("json", '{"type":"object","properties":{"x":{},"y":{}}}')
    assert c.key != a.key                          # the order the output writes them in
    assert Spec.choice(["a", "b", "a"]).value == '["a","b"]'
    assert Spec.tagged_json("<t>", {"type": "object"}, "</t>").value == \
        json.dumps({"begin": "<t>", "schema": {"type": "object"}, "end": "</t>"},
                   separators=(",", ":"))


@pytest.mark.parametrize("make, arg, message", [
    (Spec.json_schema, "{bad", "the JSON schema is not valid JSON"),
    (Spec.json_schema, [1], "a JSON schema must be an object"),
    (Spec.regex, "", "the regex must be a non-empty string"),
    (Spec.choice, [], "choice must be a non-empty list of non-empty strings"),
    (Spec.choice, ["a", ""], "choice must be a non-empty list of non-empty strings"),
    (Spec.grammar, "  ", "the grammar must be a non-empty EBNF string"),
])
def test_malformed_specs(make, arg, message):
    with pytest.raises(StructuredOutputError, match=message):
        make(arg)


def test_choice_and_tagged_json_grammars(matches):
    choice = Spec.choice(['say "hi"', "naïve\n"])
    assert matches(choice, 'say "hi"') and matches(choice, "naïve\n")
    assert not matches(choice, "say hi")
    tagged = Spec.tagged_json("<tool_call>\n", {"type": "object", "properties": {
        "name": {"const": "f"}}, "required": ["name"]}, "\n</tool_call>")
    assert matches(tagged, '<tool_call>\n{"name": "f"}\n</tool_call>')
    assert not matches(tagged, '{"name": "f"}')
    obj = Spec.json_object()
    assert matches(obj, '{"a": [1, {"b": null}]}') and not matches(obj, "[1]")
