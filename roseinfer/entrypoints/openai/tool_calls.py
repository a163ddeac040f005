"""Tool calling on /v1/chat/completions: which tools, which choice, and how an answer becomes `tool_calls`.

The chat template shows the model the `tools` (their JSON schemas) and how to call one; what the model writes
back is read according to `tool_choice`:

    tool_choice                  the model's output is                     read by              finish_reason
    "none"                       text (the tools are still shown)          nothing              the engine's
    "auto" (the default with     text, or calls in its own markup          --tool-call-parser   "tool_calls" if it
      tools; needs the flags)                                              (tool_parsers/)        called one
    {"type": "function",         the function's arguments object: forced   here                 the engine's
     "function": {"name": f}}      by a JSON schema, the tool's parameters                        (OpenAI's too)
    "required"                   [{"name": ..., "parameters": {...}}, ...] here                 "tool_calls"
                                   forced by a JSON schema built from every
                                   tool (maxItems 1 with parallel_tool_calls false)

"required" and a named function work with any model, since the engine cannot produce anything else than the
JSON (structured outputs: the schema is the request's constraint); "auto" leaves the model free, so the server
must know its markup: `roseinfer serve --enable-auto-tool-choice --tool-call-parser hermes` (vLLM's flags).

The answer carries the calls in OpenAI's shape, each with its own id:

    "message": {"role": "assistant", "content": null, "tool_calls": [{"id": "chatcmpl-tool-3f0c...",
                "type": "function", "function": {"name": "get_weather", "arguments": "{\\"city\\": \\"Paris\\"}"}}]}

Streaming, a call is a delta `{"tool_calls": [{"index": 0, "id": ..., "type": "function", "function": {"name":
..., "arguments": ...}}]}`; a named function's arguments stream as they are generated (more deltas with only
`index` and `function.arguments`), the other calls are sent whole once their JSON is complete.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from roseinfer.entrypoints.openai.errors import APIError
from roseinfer.entrypoints.openai.protocol import ChatCompletionRequest
from roseinfer.entrypoints.openai.tool_parsers import DeltaMessage, ToolCall, ToolParser

EMPTY_OBJECT = {"type": "object", "properties": {}}


@dataclass
class ToolChoice:
    """What the request asked for: kind "none", "auto", "required" or "named" (the function `name`)."""

    kind: str
    tools: list[dict] = field(default_factory=list)  # as the template reads them
    name: str | None = None
    parser: type[ToolParser] | None = None  # "auto": the server's --tool-call-parser

    def schema(self, parallel_tool_calls: bool | None) -> dict | None:
        """The JSON schema that forces "required" or a named function (None for "none" and "auto")."""
        params = {t["function"]["name"]: t["function"].get("parameters") or EMPTY_OBJECT for t in self.tools}
        if self.kind == "named":
            return params[self.name]
        if self.kind != "required":
            return None
        defs: dict[str, Any] = {}
        for p in params.values():  # "$ref": "#/$defs/..." must resolve from the root of the array's schema
            for key, value in (p.get("$defs") or {}).items():
                if defs.setdefault(key, value) != value:
                    raise APIError(400, f"tools define $defs.{key} twice, differently", "tools")
        one_call = [{"properties": {"name": {"type": "string", "enum": [name]},
                                    "parameters": {k: v for k, v in p.items() if k != "$defs"}},
                     "required": ["name", "parameters"]} for name, p in params.items()]  # fmt: skip
        schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": one_call}}
        if parallel_tool_calls is False:
            schema["maxItems"] = 1
        return schema | ({"$defs": defs} if defs else {})


def tool_choice(request: ChatCompletionRequest, auto_parser: type[ToolParser] | None) -> ToolChoice:
    """The request's tools and tool_choice, checked (a 400 naming the problem); `auto_parser`: the server's
    --tool-call-parser if --enable-auto-tool-choice is on, else None."""
    choice, tools = request.tool_choice, request.tools
    if tools is not None and not tools:
        raise APIError(400, "tools must not be an empty list: give at least one tool, or leave tools out", "tools")
    names: list[str] = []
    for i, t in enumerate(tools or []):
        name, params = t.function.name, t.function.parameters
        if not name:
            raise APIError(400, f"tools[{i}].function.name must not be empty", "tools")
        if name in names:
            raise APIError(400, f"tools[{i}].function.name: {name!r} is given twice: each tool needs its own name",
                           "tools")  # fmt: skip
        if params is not None and params.get("type", "object") != "object":
            raise APIError(400, f"tools[{i}].function.parameters must be the JSON schema of an object (the "
                                f"arguments), got type {params['type']!r}", "tools")  # fmt: skip
        names.append(name)
    dumped = [t.model_dump(exclude_none=True) for t in tools or []]
    if choice is None:
        choice = "auto" if tools else "none"  # as OpenAI and vLLM
    if choice == "none":
        return ToolChoice("none", dumped)
    if not tools:
        raise APIError(400, f"tool_choice {json.dumps(_plain(choice))} needs tools: give the functions in tools",
                       "tool_choice")  # fmt: skip
    if choice == "auto":
        if auto_parser is None:
            raise APIError(400, '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be '
                                'set (start the server with both), or use tool_choice "required", "none" or a named '
                                "function", "tool_choice")  # fmt: skip
        return ToolChoice("auto", dumped, parser=auto_parser)
    if choice == "required":
        return ToolChoice("required", dumped)
    if choice.function.name not in names:
        raise APIError(400, f"tool_choice names the function {choice.function.name!r}, which is not in tools "
                            f"({', '.join(names)})", "tool_choice")  # fmt: skip
    return ToolChoice("named", dumped, name=choice.function.name)


def _plain(choice) -> Any:
    return choice if isinstance(choice, str) else choice.model_dump()


def tool_call_arguments(message: dict, i: int) -> None:
    """An assistant message's `tool_calls`, checked, with each `function.arguments` (JSON text, as OpenAI sends
    them back) parsed into an object, as chat templates read them (vLLM does the same)."""
    calls = message.get("tool_calls")
    where = f"messages[{i}].tool_calls"
    if not isinstance(calls, list):
        raise APIError(400, f"{where} must be a list of tool calls", "messages")
    for j, call in enumerate(calls):
        fn = call.get("function") if isinstance(call, dict) else None
        bad = not isinstance(fn, dict) or call.get("type", "function") != "function"
        if bad or not isinstance(fn.get("name"), str):
            raise APIError(400, f'{where}[{j}] must be {{"id": ..., "type": "function", "function": {{"name": ..., '
                                f'"arguments": "<JSON text>"}}}}', "messages")  # fmt: skip
        args = fn.get("arguments", "{}")
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except ValueError as e:
                raise APIError(400, f"{where}[{j}].function.arguments is not JSON: {e}", "messages") from e
        if not isinstance(args, dict):
            raise APIError(400, f"{where}[{j}].function.arguments must be a JSON object", "messages")
        fn["arguments"] = args


class ToolCallReader:
    """One choice's text -> what to send: `feed(delta_text, finished)` returns a DeltaMessage or None. The
    non-streaming answer gathers the same deltas, so both ways give the same calls and text."""

    def __init__(self, choice: ToolChoice, tokenizer=None):
        self.choice, self.text, self.calls = choice, "", 0
        self.parser = choice.parser(tokenizer, choice.tools) if choice.kind == "auto" else None
        self.named_id: str | None = None
        self.decoded = 0  # "required": the array's text up to here is read

    def feed(self, delta_text: str, finished: bool) -> DeltaMessage | None:
        previous, self.text = self.text, self.text + delta_text
        if self.parser is not None:
            out = self.parser.extract_tool_calls_streaming(previous, self.text, delta_text, None, finished)
        elif self.choice.kind == "named":
            out = self._named(delta_text)
        else:
            out = self._required(finished)
        if out is not None:
            self.calls += sum(1 for c in out.tool_calls if c.id)  # a named function's fragments are not new calls
        return out

    def _named(self, delta_text: str) -> DeltaMessage | None:
        """The whole output is the arguments: the first piece opens the call, the others add to it."""
        if not delta_text:
            return None
        if self.named_id is None:
            call = ToolCall(self.choice.name, delta_text)
            self.named_id = call.id
            return DeltaMessage(tool_calls=[call])
        return DeltaMessage(tool_calls=[ToolCall("", delta_text, id="")])  # a fragment of the open call

    def _required(self, finished: bool) -> DeltaMessage | None:
        """[{"name": ..., "parameters": {...}}, ...]: each object is sent as a call once it is complete. If the
        output holds no call at all (cut by max_tokens), it is sent as text at the end."""
        out, decoder = DeltaMessage(), json.JSONDecoder()
        while True:
            i = self.decoded
            while i < len(self.text) and (self.text[i].isspace() or self.text[i] in "[,"):
                i += 1
            try:
                obj, end = decoder.raw_decode(self.text, i)
            except ValueError:
                break
            self.decoded = end
            if isinstance(obj, dict) and isinstance(obj.get("name"), str):
                out.tool_calls.append(ToolCall(obj["name"], json.dumps(obj.get("parameters", {}), ensure_ascii=False)))
        if finished and not self.calls and not out.tool_calls and self.text.strip():
            out.content = self.text
        return out if out.tool_calls or out.content else None

    def finish_reason(self, engine_reason: str) -> str:
        """OpenAI's: "tool_calls" when a call was made by "auto" or "required" and the output ended by itself."""
        if self.calls and self.choice.kind in ("auto", "required") and engine_reason == "stop":
            return "tool_calls"
        return engine_reason

    def delta(self, out: DeltaMessage) -> dict:
        """A DeltaMessage as an OpenAI delta; the calls numbered in the choice (`index`)."""
        delta: dict[str, Any] = {"content": out.content} if out.content else {}
        if out.tool_calls:
            first = self.calls - sum(1 for c in out.tool_calls if c.id)
            delta["tool_calls"] = [_call_delta(first + k, c) for k, c in enumerate(out.tool_calls)]
        return delta


def _call_delta(index: int, call: ToolCall) -> dict:
    if not call.id:  # a named function's next fragment of arguments
        return {"index": 0, "function": {"arguments": call.arguments}}
    return {"index": index} | call.to_openai()
