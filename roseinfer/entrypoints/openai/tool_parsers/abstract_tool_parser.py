"""What a tool parser is: a model's own markup for "call this function" in, OpenAI's `tool_calls` out.

A chat template tells the model which tools it has and how to call one; each model family learned its own
syntax, so the server needs one parser per syntax, chosen with `--tool-call-parser NAME`:

    hermes        <tool_call>\\n{"name": "get_weather", "arguments": {"city": "Paris"}}\\n</tool_call>
    llama3_json   {"name": "get_weather", "parameters": {"city": "Paris"}}    (several: separated by ";")

A parser works on the *text* of one choice. `extract_tool_calls(model_output)` reads a finished answer: the
calls, and the text that is not part of a call (the reply's `content`, None if there is none).
`extract_tool_calls_streaming(previous_text, current_text, delta_text, finished=...)` is called once per new
piece of a streamed answer and returns what to send now (a `DeltaMessage`: text, calls, or None). It keeps its
state between calls, so a parser object serves one choice of one request. The parsers here hold back whatever
may still turn into a call (a "<tool_call" that is not closed yet) and send each call whole, once its JSON is
complete; their non-streaming answer is the streaming one gathered, so both agree on every text.

vLLM's streaming method also takes the token ids of each text; these parsers only read the text, and take
`finished=True` on the last piece instead (a call cut off by `max_tokens` is decided then).
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any


def make_tool_call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


@dataclass
class ToolCall:
    """One call: `arguments` is the arguments object as JSON text (OpenAI's `function.arguments`)."""

    name: str
    arguments: str
    id: str = field(default_factory=make_tool_call_id)

    def to_openai(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass
class ExtractedToolCallInformation:
    tools_called: bool
    tool_calls: list[ToolCall]
    content: str | None


@dataclass
class DeltaMessage:
    """What one streamed piece adds: text for `content`, and calls that are now complete."""

    content: str | None = None
    tool_calls: list[ToolCall] = field(default_factory=list)


def parse_call(obj: Any, args_keys: tuple[str, ...]) -> ToolCall | None:
    """{"name": str, <one of args_keys>: an object (or its JSON text)} -> a ToolCall; None if it is not one."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    key = next((k for k in args_keys if k in obj), None)
    args = obj.get(key, {}) if key is not None else {}
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False))


class ToolParser:
    """The interface (vLLM's abstract ToolParser): one subclass per markup, one object per streamed choice."""

    def __init__(self, tokenizer=None, tools: list[dict] | None = None):
        self.model_tokenizer, self.tools = tokenizer, tools or []

    def extract_tool_calls(self, model_output: str, request=None) -> ExtractedToolCallInformation:
        """A finished answer: its calls and the rest of its text. By default the streaming parse of the whole
        text in one piece, on a fresh parser, so that both ways agree."""
        delta = type(self)(self.model_tokenizer, self.tools).extract_tool_calls_streaming(
            "", model_output, model_output, request, finished=True
        )
        delta = delta or DeltaMessage()
        return ExtractedToolCallInformation(bool(delta.tool_calls), delta.tool_calls, delta.content or None)

    def extract_tool_calls_streaming(self, previous_text: str, current_text: str, delta_text: str, request=None,
                                     finished: bool = False) -> DeltaMessage | None:  # fmt: skip
        raise NotImplementedError


class ToolParserManager:
    """The parsers by name: `@ToolParserManager.register_module("hermes")` on a class registers it."""

    tool_parsers: dict[str, type[ToolParser]] = {}

    @classmethod
    def register_module(cls, name: str):
        def register(parser: type[ToolParser]) -> type[ToolParser]:
            cls.tool_parsers[name] = parser
            return parser

        return register

    @classmethod
    def get_tool_parser(cls, name: str) -> type[ToolParser]:
        if name not in cls.tool_parsers:
            raise KeyError(f"no tool parser {name!r}: the parsers are {', '.join(cls.list_registered())}")
        return cls.tool_parsers[name]

    @classmethod
    def list_registered(cls) -> list[str]:
        return sorted(cls.tool_parsers)
