"""Tool calling in the chat endpoint: the request's ToolPlan, and its output as OpenAI's message
(`tool_calls`, content null) or stream deltas, with finish_reason "tool_calls"."""
from __future__ import annotations

from typing import Any

from kvmesh.api.errors import bad_request
from kvmesh.api.protocol import ChatCompletionRequest
from kvmesh.api.tool_parsers import ToolStream, get_tool_parser
from kvmesh.api.tools import ToolPlan, plan_tools
from kvmesh.engine.structured.spec import StructuredOutputError, StructuredOutputSpec


def tool_plan(ctx, req: ChatCompletionRequest) -> ToolPlan | None:
    parser = ctx.tool_parser or get_tool_parser("auto", ctx.tokenizer.chat_template)
    try:
        return plan_tools(parser, req.tools, req.tool_choice, req.parallel_tool_calls,
                          req._named_tool)
    except StructuredOutputError as e:
        raise bad_request(str(e), param=e.param or "tools") from None


def output_constraint(plan: ToolPlan | None, structured: tuple[StructuredOutputSpec, str] | None
                      ) -> tuple[StructuredOutputSpec, str] | None:
    """The one constraint of the request: a response format, or the forced tool call."""
    if plan is None or plan.spec is None:
        return structured
    if structured is not None:
        raise bad_request(f"{structured[1]} cannot be combined with tool_choice \"required\" "
                          "or a named function: both constrain the output",
                          param=structured[1])
    return plan.spec, "tools"


def finish_reason(has_calls: bool, reason: str | None) -> str | None:
    return "tool_calls" if has_calls and reason == "stop" else reason


def chat_message(plan: ToolPlan | None, text: str, reason: str | None
                 ) -> tuple[dict[str, Any], str | None]:
    """The assistant message of a finished choice and its finish_reason."""
    if plan is None or plan.parser is None:
        return {"role": "assistant", "content": text}, reason
    found = plan.parser.extract(text)
    if not found.calls:
        return {"role": "assistant", "content": text}, reason
    return ({"role": "assistant", "content": found.content,
             "tool_calls": [c.to_openai() for c in found.calls]},
            finish_reason(True, reason))


class ChoiceDeltas:
    """One streamed choice: its text as content deltas, or content and tool_calls deltas."""

    def __init__(self, plan: ToolPlan | None) -> None:
        parser = plan.parser if plan is not None else None
        self._tools = ToolStream(parser) if parser is not None else None

    def feed(self, delta_text: str, finished: bool) -> list[dict[str, Any]]:
        if self._tools is None:
            return [{"content": delta_text}] if delta_text else []
        return self._tools.feed(delta_text, final=finished)

    def finish_reason(self, reason: str | None) -> str | None:
        return finish_reason(self._tools is not None and self._tools.has_calls, reason)
