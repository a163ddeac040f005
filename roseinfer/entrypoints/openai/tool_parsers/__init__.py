"""Tool parsers by name (`--tool-call-parser NAME`), vLLM's layout: one module per model family's markup.

abstract_tool_parser.py   ToolParser (the interface), ToolCall, DeltaMessage, ToolParserManager (the registry)
hermes_tool_parser.py     hermes: <tool_call>{"name": ..., "arguments": {...}}</tool_call> (Hermes, Qwen2.5, Qwen3)
llama_tool_parser.py      llama3_json: {"name": ..., "parameters": {...}}; ... (Llama 3.1+)
"""

from roseinfer.entrypoints.openai.tool_parsers import hermes_tool_parser, llama_tool_parser  # noqa: F401  (register)
from roseinfer.entrypoints.openai.tool_parsers.abstract_tool_parser import (
    DeltaMessage,
    ExtractedToolCallInformation,
    ToolCall,
    ToolParser,
    ToolParserManager,
)

__all__ = ["DeltaMessage", "ExtractedToolCallInformation", "ToolCall", "ToolParser", "ToolParserManager"]
