"""Tools on the gRPC Chat API (router process): a tandem.v1.ChatRequest's messages, tools and
tool_choice as the dicts the HTTP API hands the frontend, and the chunks of its answer read by
the tool-call parser. The rules, limits and 400s are the HTTP API's (router/tool_choice.py); a
tool's ``parameters`` arrive as JSON text, decoded here with the same depth bound."""
from __future__ import annotations

import dataclasses

from protos.tandem.v1 import tandem_pb2
from router import errors
from router.frontend import Frontend, TextChunk
from router.json_limits import loads_bounded
from router.tool_choice import CHOICES, MAX_TOOLS, AnswerReader, ToolRequest


def chat_messages(request: tandem_pb2.ChatRequest) -> list[dict]:
    messages = []
    for m in request.messages:
        message = {"role": m.role, "content": m.content}
        if m.tool_calls:
            message["tool_calls"] = [{"id": c.id, "type": "function",
                                      "function": {"name": c.name, "arguments": c.arguments}} for c in m.tool_calls]
        if m.tool_call_id:
            message["tool_call_id"] = m.tool_call_id
        messages.append(message)
    return messages


def tool_request(frontend: Frontend, request: tandem_pb2.ChatRequest) -> ToolRequest | None:
    """The request's tools as the HTTP API reads them; RouterError 400 for what cannot hold."""
    if len(request.tools) > MAX_TOOLS:   # counted before one is decoded
        raise errors.invalid_request(f"at most {MAX_TOOLS} tools, got {len(request.tools)}", "tools")
    tools = []
    for i, tool in enumerate(request.tools):
        function: dict = {"name": tool.name}
        if tool.description:
            function["description"] = tool.description
        if tool.parameters:
            parameters = loads_bounded(tool.parameters)
            if not isinstance(parameters, dict):
                raise errors.invalid_request(f"tools[{i}].parameters must be a JSON Schema object as JSON text "
                                             "(nested at most 128 deep)", "tools")
            function["parameters"] = parameters
        tools.append({"type": "function", "function": function})
    if request.tool_choice not in ("", *CHOICES):
        raise errors.invalid_request(f"tool_choice must be one of {CHOICES} (tool_choice_function names a tool)",
                                     "tool_choice")
    if request.tool_choice and request.tool_choice_function:
        raise errors.invalid_request("give tool_choice or tool_choice_function, not both", "tool_choice")
    choice: str | dict | None = request.tool_choice or None
    if request.tool_choice_function:
        choice = {"type": "function", "function": {"name": request.tool_choice_function}}
    parallel = request.parallel_tool_calls if request.HasField("parallel_tool_calls") else None
    return frontend.tool_request(tools, choice, parallel)


def read_tool_calls(reader: AnswerReader | None, chunk: TextChunk) -> TextChunk:
    """``chunk`` as the parser reads it: content for text, the calls it completed, finish_reason
    ``tool_calls`` when the model stopped after calling."""
    if reader is None:
        return chunk
    parsed, finish = reader.read(chunk.text, chunk.finish_reason)
    return dataclasses.replace(chunk, text=parsed.content, finish_reason=finish, tool_calls=parsed.tool_calls)


def fill_tool_calls(msg: tandem_pb2.CompletionChunk, chunk: TextChunk) -> None:
    for call in chunk.tool_calls:
        msg.tool_calls.add(id=call.id, name=call.name, arguments=call.arguments)
