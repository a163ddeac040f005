"""`--tool-call-parser hermes`: calls in <tool_call> tags, as Hermes 2 Pro, Qwen2.5 and Qwen3 write them.

    I will look it up.
    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

Each tag holds one JSON object with the function's `name` and its `arguments` object; a reply may hold several
tags. The text outside the tags is the reply's `content` ("I will look it up.\\n" above); a stretch of it that is
only whitespace (the newlines between two calls) is dropped. A tag whose JSON is malformed, or is not a call,
stays in the content as it was written, so nothing the model wrote is lost. A tag left open at the end (the
answer hit `max_tokens`) is a call if what follows it is a whole call, else text.

Streaming, text is sent as it comes, except a tail that may be the start of "<tool_call>"; a call is sent whole
once its closing tag arrives.
"""

from __future__ import annotations

import json

from roseinfer.entrypoints.openai.tool_parsers.abstract_tool_parser import (
    DeltaMessage,
    ToolParser,
    ToolParserManager,
    parse_call,
)

START, END = "<tool_call>", "</tool_call>"


def partial_tag(text: str, tag: str) -> int:
    """How many characters at the end of `text` may be the start of `tag` (0 if none)."""
    return next((k for k in range(min(len(tag) - 1, len(text)), 0, -1) if text.endswith(tag[:k])), 0)


@ToolParserManager.register_module("hermes")
class Hermes2ProToolParser(ToolParser):
    def __init__(self, tokenizer=None, tools: list[dict] | None = None):
        super().__init__(tokenizer, tools)
        self.pos = 0  # current_text[:pos] is dealt with
        self.inside, self.tag_at = False, 0  # in an open tag, which starts at tag_at
        self.pending, self.started = "", False  # the current stretch of text: its held whitespace, sent yet?

    def extract_tool_calls_streaming(self, previous_text: str, current_text: str, delta_text: str, request=None,
                                     finished: bool = False) -> DeltaMessage | None:  # fmt: skip
        out, text = DeltaMessage(content=""), current_text
        while True:
            if self.inside:
                end = text.find(END, self.pos)
                if end < 0 and not finished:
                    break
                stop = len(text) if end < 0 else end + len(END)
                self._close(text[self.pos : len(text) if end < 0 else end], text[self.tag_at : stop], out)
                self.pos, self.inside = stop, False
                continue
            start = text.find(START, self.pos)
            if start < 0:
                safe = len(text) if finished else len(text) - partial_tag(text[self.pos :], START)
                self._text(text[self.pos : safe], out)
                self.pos = safe
                break
            self._text(text[self.pos : start], out)
            self.pending, self.started = "", False  # a tag ends the stretch of text
            self.tag_at, self.pos, self.inside = start, start + len(START), True
        out.content = out.content or None
        return out if out.content or out.tool_calls else None

    def _close(self, inner: str, raw: str, out: DeltaMessage) -> None:
        """A tag's JSON: a call, or (malformed) its whole text as a stretch of content of its own."""
        try:
            call = parse_call(json.loads(inner), ("arguments", "parameters"))
        except ValueError:
            call = None
        if call is not None:
            out.tool_calls.append(call)
            return
        self._text(raw, out)
        self.pending, self.started = "", False

    def _text(self, piece: str, out: DeltaMessage) -> None:
        """Text outside the tags: sent, but a stretch's leading whitespace only once something else follows."""
        if self.started:
            out.content += piece
            return
        self.pending += piece
        if self.pending.strip():
            out.content += self.pending
            self.pending, self.started = "", True
