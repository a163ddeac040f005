"""Stage 21's server side without a server: the tool parsers on hand-written texts (whole and streamed piece by
piece), the schemas that force "required" and named tool calls, the request fields that become one
StructuredOutputsParams, and the tiny Llama's chat template with tools (the end-to-end tests that need the
engine's constraints: test_21_server_structured.py)."""

from __future__ import annotations

import json

import jsonschema
import pytest
from conftest import REPO

from roseinfer.entrypoints import chat_utils
from roseinfer.entrypoints.openai.errors import APIError
from roseinfer.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
from roseinfer.entrypoints.openai.structured_outputs import structured_outputs_params
from roseinfer.entrypoints.openai.tool_calls import ToolCallReader, tool_choice
from roseinfer.entrypoints.openai.tool_parsers import ToolParserManager
from roseinfer.tokenizer import Tokenizer

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
           "required": ["city"]}  # fmt: skip
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "description": "now"}}]  # fmt: skip
MESSAGES = [{"role": "user", "content": "Weather?"}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}


def parse(name: str, text: str):
    return ToolParserManager.get_tool_parser(name)().extract_tool_calls(text)


def stream(name: str, text: str, step: int = 1) -> tuple[str | None, list]:
    """The text fed to a fresh parser `step` characters at a time: (the content sent, the calls sent)."""
    parser, previous, content, calls = ToolParserManager.get_tool_parser(name)(), "", "", []
    pieces = [text[i : i + step] for i in range(0, len(text), step)] or [""]
    for k, piece in enumerate(pieces):
        current = previous + piece
        out = parser.extract_tool_calls_streaming(previous, current, piece, finished=k == len(pieces) - 1)
        previous = current
        if out is not None:
            content += out.content or ""
            calls += out.tool_calls
    return content or None, calls


def calls_of(calls) -> list[tuple[str, dict]]:
    return [(c.name, json.loads(c.arguments)) for c in calls]


CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
HERMES = [  # text, the calls, the content
    (CALL, [("get_weather", {"city": "Paris"})], None),
    (
        CALL + "\n" + CALL.replace("Paris", "Rome") + "\n",
        [("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Rome"})],
        None,
    ),
    ("Let me look.\n" + CALL + "\nDone.", [("get_weather", {"city": "Paris"})], "Let me look.\n\nDone."),
    ("<tool_call>{not json}</tool_call> after", [], "<tool_call>{not json}</tool_call> after"),
    ("a <tool_call>[1, 2]</tool_call>" + CALL, [("get_weather", {"city": "Paris"})], "a <tool_call>[1, 2]</tool_call>"),
    ('<tool_call>{"name": "get_time", "arguments": {}}', [("get_time", {})], None),  # cut before its closing tag
    ('<tool_call>{"name": "get_time", "argu', [], '<tool_call>{"name": "get_time", "argu'),
    ("no call here <tool_c", [], "no call here <tool_c"),
    ("", [], None),
]


@pytest.mark.parametrize(("text", "want_calls", "want_content"), HERMES, ids=[t[:30] for t, _, _ in HERMES])
def test_hermes_parser_whole_and_streamed(text, want_calls, want_content):
    info = parse("hermes", text)
    assert calls_of(info.tool_calls) == want_calls and info.content == want_content
    assert info.tools_called == bool(want_calls)
    assert all(c.id.startswith("chatcmpl-tool-") and len(c.id) == len("chatcmpl-tool-") + 32 for c in info.tool_calls)
    for step in (1, 3, 7, len(text) or 1):
        content, calls = stream("hermes", text, step)
        assert calls_of(calls) == want_calls and content == want_content, step


def test_hermes_streaming_holds_back_a_partial_tag_and_sends_a_call_when_it_closes():
    parser = ToolParserManager.get_tool_parser("hermes")()
    out = parser.extract_tool_calls_streaming("", "Hi <tool", "Hi <tool")
    assert out.content == "Hi " and not out.tool_calls  # "<tool" may open a tag: held back
    text = "Hi " + CALL[:-3]
    assert parser.extract_tool_calls_streaming("Hi <tool", text, text[8:]) is None  # inside, not closed yet
    out = parser.extract_tool_calls_streaming(text, "Hi " + CALL, CALL[-3:])
    assert out.content is None and calls_of(out.tool_calls) == [("get_weather", {"city": "Paris"})]


ONE = '{"name": "get_weather", "parameters": {"city": "Paris"}}'
LLAMA = [
    (ONE, [("get_weather", {"city": "Paris"})], None),
    ("<|python_tag|>" + ONE, [("get_weather", {"city": "Paris"})], None),
    (
        f' {ONE}; {{"name": "get_time", "arguments": {{}}}};',
        [("get_weather", {"city": "Paris"}), ("get_time", {})],
        None,
    ),
    ("It is " + ONE, [], "It is " + ONE),  # text first: not a call
    (ONE + " and more", [], ONE + " and more"),  # text after: not a call either
    ('{"name": "get_weather", "parameters": {"city": ', [], '{"name": "get_weather", "parameters": {"city": '),
    ('{"city": "Paris"}', [], '{"city": "Paris"}'),  # JSON, but no name: not a call
    ("Romeo, Romeo", [], "Romeo, Romeo"),
]


@pytest.mark.parametrize(("text", "want_calls", "want_content"), LLAMA, ids=[t[:30] for t, _, _ in LLAMA])
def test_llama3_json_parser_whole_and_streamed(text, want_calls, want_content):
    info = parse("llama3_json", text)
    assert calls_of(info.tool_calls) == want_calls and info.content == want_content
    for step in (1, 4, len(text)):
        content, calls = stream("llama3_json", text, step)
        assert calls_of(calls) == want_calls and content == want_content, step


def test_llama3_json_streams_plain_text_at_once_and_holds_a_call():
    parser = ToolParserManager.get_tool_parser("llama3_json")()
    assert parser.extract_tool_calls_streaming("", " <|py", " <|py") is None  # maybe the python tag
    assert parser.extract_tool_calls_streaming(" <|py", " <|pyx", "x").content == " <|pyx"  # not: all of it, now
    parser = ToolParserManager.get_tool_parser("llama3_json")()
    assert parser.extract_tool_calls_streaming("", ONE[:10], ONE[:10]) is None
    out = parser.extract_tool_calls_streaming(ONE[:10], ONE, ONE[10:], finished=True)
    assert calls_of(out.tool_calls) == [("get_weather", {"city": "Paris"})]
    with pytest.raises(KeyError, match="hermes, llama3_json"):
        ToolParserManager.get_tool_parser("nope")


def chat_request(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"messages": MESSAGES, **fields})


def test_required_and_named_schemas_accept_exactly_the_calls():
    named = tool_choice(chat_request(tools=TOOLS, tool_choice=NAMED), None)
    assert named.kind == "named" and named.schema(None) == WEATHER
    empty = tool_choice(chat_request(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_time"}}),
                        None)  # fmt: skip
    assert empty.schema(None) == {"type": "object", "properties": {}}
    required = tool_choice(chat_request(tools=TOOLS, tool_choice="required"), None)
    schema = required.schema(None)
    jsonschema.validate([{"name": "get_weather", "parameters": {"city": "Paris"}}, {"name": "get_time",
                         "parameters": {}}], schema)  # fmt: skip
    for bad in ([], [{"name": "get_weather", "parameters": {"days": 2}}], [{"name": "nope", "parameters": {}}],
                [{"name": "get_time"}], {"name": "get_time", "parameters": {}}):  # fmt: skip
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    one = required.schema(False)
    jsonschema.validate([{"name": "get_time", "parameters": {}}], one)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "get_time", "parameters": {}}] * 2, one)
    assert tool_choice(chat_request(tools=TOOLS, tool_choice="none"), None).schema(None) is None
    hermes = ToolParserManager.get_tool_parser("hermes")
    assert tool_choice(chat_request(tools=TOOLS), hermes).kind == "auto"  # the default with tools
    ref = {"type": "object", "properties": {"p": {"$ref": "#/$defs/P"}}, "$defs": {"P": {"type": "integer"}}}
    tools = [{"type": "function", "function": {"name": "f", "parameters": ref}}]
    schema = tool_choice(chat_request(tools=tools, tool_choice="required"), None).schema(None)
    jsonschema.validate([{"name": "f", "parameters": {"p": 3}}], schema)  # $defs moved to the root: $ref resolves
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "f", "parameters": {"p": "x"}}], schema)


@pytest.mark.parametrize(("fields", "match"), [
    ({"tools": []}, "must not be an empty list"),
    ({"tool_choice": "required"}, "needs tools"),
    ({"tool_choice": {"type": "function", "function": {"name": "f"}}}, "needs tools"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "f"}}}, "'f', which is not in tools"),
    ({"tools": TOOLS}, "--enable-auto-tool-choice and --tool-call-parser"),
    ({"tools": TOOLS, "tool_choice": "auto"}, "--enable-auto-tool-choice and --tool-call-parser"),
    ({"tools": [TOOLS[0], TOOLS[0]]}, "given twice"),
    ({"tools": [{"type": "function", "function": {"name": ""}}]}, "must not be empty"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]}, "of an object"),
])  # fmt: skip
def test_bad_tools_and_tool_choice_are_400_naming_the_problem(fields, match):
    with pytest.raises(APIError, match=match) as e:
        tool_choice(chat_request(**fields), None)
    assert e.value.status_code == 400 and e.value.param in ("tools", "tool_choice")


def feed(reader: ToolCallReader, text: str, step: int) -> tuple[list[dict], str]:
    """A reader fed `step` characters at a time: the OpenAI deltas, and the finish reason for "stop"."""
    pieces = [text[i : i + step] for i in range(0, len(text), step)]
    deltas = []
    for k, piece in enumerate(pieces):
        out = reader.feed(piece, k == len(pieces) - 1)
        if out is not None:
            deltas.append(reader.delta(out))
    return deltas, reader.finish_reason("stop")


def test_tool_call_reader_required_and_named():
    required = tool_choice(chat_request(tools=TOOLS, tool_choice="required"), None)
    text = '[{"name": "get_weather", "parameters": {"city": "Paris"}}, {"name": "get_time", "parameters": {}}]'
    for step in (1, 5, len(text)):
        deltas, reason = feed(ToolCallReader(required), text, step)
        calls = [c for d in deltas for c in d["tool_calls"]]
        assert [(c["index"], c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
            (0, "get_weather", {"city": "Paris"}), (1, "get_time", {})]  # fmt: skip
        assert all(c["type"] == "function" and c["id"].startswith("chatcmpl-tool-") for c in calls)
        assert reason == "tool_calls" and not any("content" in d for d in deltas)
    deltas, reason = feed(ToolCallReader(required), '[{"name": "get_wea', 4)  # cut short: no call, the text
    assert "".join(d.get("content", "") for d in deltas) == '[{"name": "get_wea' and reason == "stop"
    named = tool_choice(chat_request(tools=TOOLS, tool_choice=NAMED), None)
    deltas, reason = feed(ToolCallReader(named), '{"city": "Paris"}', 4)
    first, rest = deltas[0]["tool_calls"][0], [d["tool_calls"][0] for d in deltas[1:]]
    assert first["function"]["name"] == "get_weather" and first["id"].startswith("chatcmpl-tool-")
    assert all(set(r) == {"index", "function"} and r["index"] == 0 for r in rest)  # fragments of the same call
    assert first["function"]["arguments"] + "".join(r["function"]["arguments"] for r in rest) == '{"city": "Paris"}'
    assert reason == "stop"  # OpenAI's finish_reason for a named function


@pytest.mark.parametrize(("fields", "want"), [
    ({"response_format": {"type": "text"}}, None),
    ({"response_format": {"type": "json_object"}}, {"json_object": True}),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "w", "schema": WEATHER, "strict": True}}},
     {"json": WEATHER}),
    ({"structured_outputs": {"regex": r"\d+", "disable_any_whitespace": True}},
     {"regex": r"\d+", "disable_any_whitespace": True}),
    ({"structured_outputs": {"json": WEATHER}}, {"json": WEATHER}),
    ({"guided_json": WEATHER}, {"json": WEATHER}),
    ({"guided_regex": "a+"}, {"regex": "a+"}),
    ({"guided_choice": ["yes", "no"]}, {"choice": ["yes", "no"]}),
    ({"guided_grammar": 'root ::= "a"'}, {"grammar": 'root ::= "a"'}),
    (  # options without a constraint apply to the one given another way (vLLM merges them the same way)
        {"response_format": {"type": "json_object"}, "structured_outputs": {"disable_any_whitespace": True}},
        {"json_object": True, "disable_any_whitespace": True, "json": None},
    ),
    (
        {"guided_choice": ["a"], "structured_outputs": {"disable_additional_properties": True}},
        {"choice": ["a"], "disable_additional_properties": True, "disable_any_whitespace": False},
    ),
])  # fmt: skip
def test_each_spelling_becomes_one_structured_outputs_params(fields, want):
    for request in (chat_request(**fields), CompletionRequest.model_validate({"prompt": "a", **fields})):
        params, field = structured_outputs_params(request)
        assert field == (
            None if want is None else next(k for k in fields if k != "structured_outputs" or len(fields) == 1)
        )
        assert (params is None) if want is None else {k: getattr(params, k) for k in want} == want


@pytest.mark.parametrize(("fields", "match"), [
    ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex and response_format both"),
    ({"guided_choice": ["a"], "structured_outputs": {"regex": "a"}}, "guided_choice and structured_outputs both"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "multiple are specified"),
    ({"structured_outputs": {"disable_any_whitespace": True}}, "needs one kind"),
    ({"guided_choice": []}, "non-empty list"),
    ({"response_format": {"type": "json_schema"}}, '"json_schema": {"name"'),
])  # fmt: skip
def test_conflicting_or_empty_constraints_are_400_naming_them(fields, match):
    with pytest.raises(APIError, match=match) as e:
        structured_outputs_params(chat_request(**fields))
    assert e.value.status_code == 400


def test_tiny_llama_template_renders_tools_calls_and_results():
    tok = Tokenizer.from_model_dir(REPO / "roseinfer" / "models" / "tiny-llama-shakespeare")
    plain = chat_utils.apply_chat_template(tok, MESSAGES)
    assert plain == ("<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nWeather?<|eot_id|>"
                     "<|start_header_id|>assistant<|end_header_id|>\n\n")  # fmt: skip
    call = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
    conv = [{"role": "system", "content": "Be brief."}, *MESSAGES, {"role": "assistant", "content": None,
            "tool_calls": [call]}, {"role": "tool", "tool_call_id": "c1", "content": "Sunny"}]  # fmt: skip
    text = chat_utils.apply_chat_template(tok, conv, tools=TOOLS)
    head, rest = text.split("<|eot_id|>", 1)
    assert head.startswith("<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nBe brief.\n\n")
    assert all(json.dumps(t) in head for t in TOOLS) and "<tool_call>" in head  # the tools and how to call one
    assert '<|start_header_id|>assistant<|end_header_id|>\n\n<tool_call>\n{"name": "get_weather", "arguments": ' \
           '{"city": "Paris"}}\n</tool_call><|eot_id|>' in rest  # fmt: skip
    assert "<|start_header_id|>tool<|end_header_id|>\n\n<tool_response>\nSunny\n</tool_response><|eot_id|>" in rest
    assert rest.endswith("<|start_header_id|>assistant<|end_header_id|>\n\n") and "Be brief" not in rest
    assert chat_utils.render_with_jinja2(tok.chat_template, conv, True, tools=TOOLS, **tok.special_tokens_map) == text
