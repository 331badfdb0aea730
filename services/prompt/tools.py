"""Tools in prompts: the default rendering for chat templates that do not know tools.

A template that mentions `tools` renders them itself (the `tools=` argument); one that mentions
`tool_calls` renders an assistant's calls. For the others (ChatML templates such as the built-in
SmolLM2's), the renderer writes the Hermes convention into the messages, so the model sees the
same format the `hermes` tool-call parser reads:

    system:    the system prompt, then a "# Tools" section: every tool's JSON inside <tools></tools>
               and how to call one: <tool_call>{"name": ..., "arguments": {...}}</tool_call>
    assistant: its content, then one <tool_call> block per call it made
    tool:      <tool_response>the result</tool_response>
"""
from __future__ import annotations

import json
import re
from typing import Any

Message = dict[str, Any]

_TOOLS_VAR = re.compile(r"\btools\b")
_TOOL_CALLS_VAR = re.compile(r"\btool_calls\b")


def template_renders_tools(template: str | None) -> bool:
    return bool(template) and _TOOLS_VAR.search(template) is not None


def template_renders_tool_calls(template: str | None) -> bool:
    return bool(template) and _TOOL_CALLS_VAR.search(template) is not None


def tools_section(tools: list[dict[str, Any]]) -> str:
    """The system-prompt section listing `tools` (OpenAI tool objects) and the call format."""
    listed = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    return ("# Tools\n\n"
            "You can call the functions below to help with the request. Their signatures are "
            "inside <tools></tools>:\n"
            f"<tools>\n{listed}\n</tools>\n\n"
            "To call a function, write a JSON object with its name and arguments inside "
            "<tool_call></tool_call>, one block per call:\n"
            '<tool_call>\n{"name": "<function name>", "arguments": {<arguments as JSON>}}\n'
            "</tool_call>")


def call_block(call: dict[str, Any]) -> str:
    fn = call.get("function") or {}
    args = fn.get("arguments", {})
    body = {"name": fn.get("name"), "arguments": args}
    return f"<tool_call>\n{json.dumps(body, ensure_ascii=False)}\n</tool_call>"


def with_default_tools(messages: list[Message], tools: list[dict[str, Any]] | None,
                       inline_tools: bool, inline_calls: bool) -> list[Message]:
    """`messages` (normalised) with the Hermes rendering written in: the tools section when
    `inline_tools`, the calls and tool results when `inline_calls`. Inputs are not changed."""
    out = [dict(m) for m in messages]
    if inline_calls:
        for m in out:
            calls = m.pop("tool_calls", None)
            if m.get("role") == "assistant" and calls:
                blocks = "\n".join(call_block(c) for c in calls)
                m["content"] = f"{m['content']}\n{blocks}" if m.get("content") else blocks
            elif m.get("role") == "tool":
                m.pop("tool_call_id", None)
                m["content"] = f"<tool_response>\n{m.get('content', '')}\n</tool_response>"
    if inline_tools and tools:
        section = tools_section(tools)
        if out and out[0].get("role") == "system":
            out[0]["content"] = f"{out[0]['content']}\n\n{section}" if out[0]["content"] else section
        else:
            out.insert(0, {"role": "system", "content": section})
    return out
