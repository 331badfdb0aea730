"""StructuredOutputSpec -> xgrammar Grammar. Parsing is cheap (no tokenizer) and is the check
a spec passes at the boundary: a bad schema, regex or grammar fails here, as a 400."""
from __future__ import annotations

import json

import xgrammar as xgr
from kvmesh.engine.structured.schema_support import check_schema
from kvmesh.engine.structured.spec import StructuredOutputError, StructuredOutputSpec

# NOTE: no free whitespace in JSON: a small model given the choice emits newlines until max_tokens.
_JSON_OPTS = {"any_whitespace": False}


def parse(spec: StructuredOutputSpec, param: str = "structured_outputs") -> xgr.Grammar:
    """The spec's grammar, or StructuredOutputError (naming `param`) saying what is wrong."""
    try:
        return _build(spec, param)
    except StructuredOutputError:
        raise
    except Exception as e:  # noqa: BLE001 - xgrammar raises RuntimeError / ValueError with its reason
        raise StructuredOutputError(f"invalid structured output {spec.kind}: {_reason(e)}",
                                    param=param) from None


def _build(spec: StructuredOutputSpec, param: str) -> xgr.Grammar:
    if spec.kind == "json":
        check_schema(json.loads(spec.value), param)
        return xgr.Grammar.from_json_schema(spec.value, **_JSON_OPTS)
    if spec.kind == "json_object":
        return xgr.Grammar.from_json_schema('{"type": "object"}', strict_mode=False, **_JSON_OPTS)
    if spec.kind == "regex":
        return xgr.Grammar.from_regex(spec.value)
    if spec.kind == "choice":
        return xgr.Grammar.from_ebnf(literal_rule(json.loads(spec.value)))
    if spec.kind == "grammar":
        return xgr.Grammar.from_ebnf(spec.value)
    assert spec.kind == "tagged_json", spec.kind
    parts = json.loads(spec.value)
    check_schema(parts["schema"], param)
    return xgr.Grammar.concat(xgr.Grammar.from_ebnf(literal_rule([parts["begin"]])),
                              xgr.Grammar.from_json_schema(json.dumps(parts["schema"]),
                                                           **_JSON_OPTS),
                              xgr.Grammar.from_ebnf(literal_rule([parts["end"]])))


def literal_rule(alternatives: list[str]) -> str:
    """`root ::= "a" | "b"`: JSON string escapes are also EBNF string escapes."""
    return "root ::= " + " | ".join(json.dumps(a) for a in alternatives)


def _reason(e: Exception) -> str:
    """xgrammar's message without its '[time] /path/file.cc:line: ' prefix."""
    text = str(e).strip()
    if text.startswith("[") and ": " in text:
        parts = text.split(": ", 1)
        if ".cc:" in parts[0] or "]" in parts[0]:
            text = parts[1]
    return text.splitlines()[0] if text else type(e).__name__
