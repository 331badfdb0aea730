"""Chat `tools` / `tool_choice` / `parallel_tool_calls`: checked once, then a ToolPlan saying what
the prompt renders, which spec (if any) constrains the output and how the output is read.

    tool_choice   prompt lists the tools   output constrained            output parsed
    none          yes                      no                            no (plain content)
    auto          yes                      no                            yes, by the parser
    required      yes                      one call to any tool          yes
    {"function"}  yes                      one call to that tool         yes

NOTE: `required` and a named function are enforced with a grammar for the parser's own format
whose arguments match the function's parameter schema, so even a small model writes a valid call.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvmesh.api.tool_parsers import ToolParser
from kvmesh.engine.structured.schema_support import check_schema
from kvmesh.engine.structured.spec import StructuredOutputSpec
from pydantic import BaseModel, ConfigDict, Field, ValidationError


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field(min_length=1, max_length=64, pattern=r"^[a-zA-Z0-9_-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ChatTool(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: str = Field(pattern="^function$")
    function: FunctionDefinition


def check_tools(tools: list[dict[str, Any]] | None, tool_choice: str | dict[str, Any] | None
                ) -> str | None:
    """ValueError (a 400) for malformed tools or a tool_choice naming no tool; returns the named
    function of tool_choice, if any. The tools stay the raw JSON the client sent: the router
    renders the same dicts, so its prompt hashes match the engine's."""
    names = []
    for i, tool in enumerate(tools or []):
        try:
            names.append(ChatTool.model_validate(tool).function.name)
        except ValidationError as e:
            raise ValueError(f"tools[{i}] is not a function tool: {e.errors()[0]['msg']}") from None
    if len(set(names)) != len(names):
        raise ValueError("tool function names must be unique")
    if tool_choice is None or tool_choice in ("none", "auto", "required"):
        if tool_choice == "required" and not names:
            raise ValueError('tool_choice "required" needs tools')
        return None
    if isinstance(tool_choice, str):
        raise ValueError(  # noqa: TRY004 - a 400 about the request's value
            f'tool_choice must be "none", "auto", "required" or '
            f'{{"type": "function", "function": {{"name": ...}}}}, got {tool_choice!r}')
    fn = tool_choice.get("function") if tool_choice.get("type") == "function" else None
    name = fn.get("name") if isinstance(fn, dict) else None
    if not isinstance(name, str):
        raise ValueError(  # noqa: TRY004 - a 400 about the request's value
            'tool_choice must be {"type": "function", "function": {"name": ...}}')
    if name not in names:
        raise ValueError(f"tool_choice names function {name!r}, which is not in tools")
    return name


@dataclass(slots=True)
class ToolPlan:
    parser: ToolParser | None        # reads calls from the output; None: tool_choice "none"
    spec: StructuredOutputSpec | None   # constrains the output (required / named function)


def plan_tools(parser: ToolParser, tools: list[dict[str, Any]] | None,
               tool_choice: str | dict[str, Any] | None, parallel_tool_calls: bool | None,
               named: str | None) -> ToolPlan | None:
    """None without tools; otherwise what to do with them (see the module docstring)."""
    if not tools:
        return None
    choice = tool_choice or "auto"
    if choice == "none":
        return ToolPlan(None, None)
    if choice == "auto":
        return ToolPlan(parser, None)
    chosen = [t for t in tools if named is None or t["function"]["name"] == named]
    for t in chosen:
        params = t["function"].get("parameters")
        if params is not None:
            check_schema(params, param="tools")
    return ToolPlan(parser, parser.constrained(chosen, parallel_tool_calls is not False))
