"""`--tool-call-parser llama3_json`: Llama 3.1+'s JSON tool calls.

    {"name": "get_weather", "parameters": {"city": "Paris"}}
    <|python_tag|>{"name": "a", "parameters": {}}; {"name": "b", "parameters": {"x": 1}}

Llama 3 answers a tool call with nothing but the call: a JSON object with the function's `name` and its
`parameters` (`arguments` is read too), optionally after the `<|python_tag|>` token, several separated by ";".
So a reply is read as calls only if it is *all* calls: one that starts with other text, or has text (or a
malformed object) after its calls, is plain `content`, whole. (vLLM's parser picks JSON objects out of any
text and drops the rest.)

Streaming, a reply that starts with "{" or "<|python_tag|>" is held until it is finished, then sent as calls
(or, if it is not all calls, as text); any other reply streams as text from its first character.
"""

from __future__ import annotations

import json

from roseinfer.entrypoints.openai.tool_parsers.abstract_tool_parser import (
    DeltaMessage,
    ToolCall,
    ToolParser,
    ToolParserManager,
    parse_call,
)

PYTHON_TAG = "<|python_tag|>"


def parse_calls(text: str) -> list[ToolCall] | None:
    """The calls if `text` is nothing but calls separated by ";", else None."""
    s = text.strip()
    s = s.removeprefix(PYTHON_TAG)
    decoder, calls, i = json.JSONDecoder(), [], 0
    while True:
        while i < len(s) and s[i].isspace():
            i += 1
        try:
            obj, i = decoder.raw_decode(s, i)
        except ValueError:
            return None
        call = parse_call(obj, ("parameters", "arguments"))
        if call is None:
            return None
        calls.append(call)
        while i < len(s) and s[i].isspace():
            i += 1
        if i == len(s):
            return calls
        if s[i] != ";":
            return None
        i += 1
        if not s[i:].strip():  # a ";" after the last call
            return calls


@ToolParserManager.register_module("llama3_json")
class Llama3JsonToolParser(ToolParser):
    def __init__(self, tokenizer=None, tools: list[dict] | None = None):
        super().__init__(tokenizer, tools)
        self.mode: str | None = None  # None: not known yet; "text"; "calls"

    def extract_tool_calls_streaming(self, previous_text: str, current_text: str, delta_text: str, request=None,
                                     finished: bool = False) -> DeltaMessage | None:  # fmt: skip
        if self.mode is None:
            head = current_text.lstrip()
            if head.startswith(("{", PYTHON_TAG)):
                self.mode = "calls"
            elif not finished and (not head or PYTHON_TAG.startswith(head)):
                return None  # only whitespace, or maybe the tag: wait
            else:
                self.mode = "text"
                return DeltaMessage(content=current_text) if head else None  # what was held, at once
        if self.mode == "text":
            return DeltaMessage(content=delta_text) if delta_text else None
        if not finished:
            return None
        calls = parse_calls(current_text)
        return DeltaMessage(tool_calls=calls) if calls else DeltaMessage(content=current_text)
