"""Stage 21 through the OpenAI-compatible server: response_format, structured_outputs and guided_* on both routes
and both bundled models, streamed too; tool calls forced by tool_choice (named, "required") and read by the
hermes parser ("auto"); and every bad input a 400 in OpenAI's shape after which the server still answers.

The tiny models write Shakespeare, not JSON: left free, they fill the whitespace a JSON grammar allows with
newlines until max_tokens, so the JSON requests ask for the compact form (`structured_outputs:
{"disable_any_whitespace": true}`), and `json_object`, which bounds nothing, is checked as the start of an object
when max_tokens cuts it. The parsers themselves are tested on hand-written texts in test_21_tool_parsers.py.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys

import httpx
import jsonschema
import openai
import pytest
from conftest import REPO
from test_13_server import assert_engine_empty, serving
from test_19_server import assert_openai_error

from benchmarks.common import server_env
from roseinfer import LLM, LLMEngine, SamplingParams, StructuredOutputsParams
from roseinfer.entrypoints import chat_utils
from roseinfer.entrypoints.async_engine import AsyncLLMEngine
from roseinfer.entrypoints.openai.tool_parsers import ToolParserManager

LLAMA = str(REPO / "roseinfer" / "models" / "tiny-llama-shakespeare")
GPT2 = str(REPO / "roseinfer" / "models" / "tiny-shakespeare")
ENGINE = {"device": "cpu", "dtype": "float32"}
PLAIN_TEMPLATE = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:"  # no tools
COMPACT = {"structured_outputs": {"disable_any_whitespace": True}}
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
          "age": {"type": "integer", "minimum": 0, "maximum": 120}}, "required": ["name", "age"],
          "additionalProperties": False}  # fmt: skip
DATE = r"\d{4}-\d{2}-\d{2}"
CHOICES = ["yes", "no", "perchance"]
WEATHER = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}, "days": {"type": "integer",
           "minimum": 1, "maximum": 7}}, "required": ["city", "days"], "additionalProperties": False}  # fmt: skip
TIME = {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": TIME}}]  # fmt: skip
PARAMS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "user", "content": "What weather in Verona?"}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}
HERMES_CALL = (r'<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "(Paris|Rome)", "days": [1-7]\}\}'
               r"\n</tool_call>")  # fmt: skip


@pytest.fixture(scope="module")
def llama():
    """The tiny Llama (its template renders tools), with --enable-auto-tool-choice --tool-call-parser hermes."""
    engine = AsyncLLMEngine(LLMEngine(LLAMA, max_num_seqs=8, **ENGINE))
    with serving(engine, tool_parser=ToolParserManager.get_tool_parser("hermes")) as (url, _):
        yield url, engine, openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)


@pytest.fixture(scope="module")
def gpt2():
    """The tiny GPT-2 with a chat template that never mentions tools, and no tool parser."""
    engine = AsyncLLMEngine(LLMEngine(GPT2, max_num_seqs=8, **ENGINE))
    with serving(engine, chat_template=PLAIN_TEMPLATE) as (url, _):
        yield url, engine, openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)


def closes_as_object(text: str) -> bool:
    """`json_object` cut by max_tokens: the text is the start of an object (these models write one endless key)."""
    for end in ("", '"}', '":0}', "}", "0}", '"]}', "]}"):
        try:
            if isinstance(json.loads(text + end), dict):
                return True
        except json.JSONDecodeError:
            pass
    return False


def check(text: str, finish_reason: str, kind: str, spec) -> None:
    """The text follows its constraint, whole (the grammar ended it: "stop")."""
    if kind == "json_object" and finish_reason == "length":
        assert text.startswith("{") and closes_as_object(text), text
        return
    assert finish_reason == "stop", (kind, text, finish_reason)
    if kind == "json":
        jsonschema.validate(json.loads(text), spec)
    elif kind == "json_object":
        assert isinstance(json.loads(text), dict), text
    elif kind == "regex":
        assert re.fullmatch(spec, text), text
    else:
        assert text in spec, text


CASES = [  # kind, what it checks against, the request fields (vLLM's extras in extra_body)
    ("json", PERSON, {"response_format": {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON,
                                                                                  "strict": True}}}, COMPACT),
    ("json", PERSON, {}, {"guided_json": PERSON, **COMPACT}),
    ("json_object", None, {"response_format": {"type": "json_object"}}, COMPACT),
    ("regex", DATE, {}, {"guided_regex": DATE}),
    ("regex", DATE, {}, {"structured_outputs": {"regex": DATE}}),
    ("choice", CHOICES, {}, {"guided_choice": CHOICES}),
    ("regex", r"\(([a-z]{1,8})\)", {}, {"structured_outputs": {"grammar": 'root ::= "(" [a-z]{1,8} ")"'}}),
]  # fmt: skip


@pytest.mark.parametrize(("kind", "spec", "fields", "extra"), CASES, ids=[str(c[2] or c[3])[:40] for c in CASES])
def test_every_constraint_holds_on_chat_and_completions_of_both_models(llama, gpt2, kind, spec, fields, extra):
    r = llama[2].chat.completions.create(model="roseinfer", messages=ASK, max_tokens=48, temperature=0, **fields,
                                         extra_body=extra)  # fmt: skip
    check(r.choices[0].message.content, r.choices[0].finish_reason, kind, spec)
    r = gpt2[2].completions.create(model="roseinfer", prompt=["ROMEO.\n", "KING."], max_tokens=48, n=2, seed=3,
                                   temperature=0.9, extra_body={**fields, **extra})  # fmt: skip
    assert len(r.choices) == 4
    for c in r.choices:
        check(c.text, c.finish_reason, kind, spec)
    assert_engine_empty(llama[1])
    assert_engine_empty(gpt2[1])


def test_the_constraint_changes_the_text():
    """Not a tautology: the same request without the constraint writes something the constraint forbids."""
    llm = LLM(LLAMA, **ENGINE)
    free = llm.generate(["ROMEO."], SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)[0].outputs[0].text
    assert not re.fullmatch(DATE, free) and free not in CHOICES
    so = StructuredOutputsParams(regex=DATE)
    held = llm.generate(["ROMEO."], SamplingParams(temperature=0, max_tokens=12, structured_outputs=so),
                        use_tqdm=False)[0].outputs[0].text  # fmt: skip
    assert re.fullmatch(DATE, held)


def stream_chat(client, **kwargs) -> tuple[str, list[dict], str]:
    """A streamed chat answer put together: (content, tool calls by index, the finish reason)."""
    content, calls, reason = "", {}, None
    for chunk in client.chat.completions.create(model="roseinfer", stream=True, **kwargs):
        for c in chunk.choices:
            content += c.delta.content or ""
            for tc in c.delta.tool_calls or []:
                if tc.id is not None:
                    assert tc.index not in calls and tc.type == "function" and tc.function.name
                    calls[tc.index] = {"id": tc.id, "name": tc.function.name, "arguments": tc.function.arguments or ""}
                else:
                    calls[tc.index]["arguments"] += tc.function.arguments
            reason = c.finish_reason or reason
    return content, [calls[i] for i in sorted(calls)], reason


def as_calls(message) -> list[dict]:
    return [{"id": t.id, "name": t.function.name, "arguments": t.function.arguments} for t in message.tool_calls or []]


@pytest.mark.parametrize("extra", [{"response_format": {"type": "json_schema", "json_schema": {"name": "p",
                                    "schema": PERSON}}} | COMPACT, {"guided_regex": DATE}])  # fmt: skip
def test_streamed_constrained_output_equals_the_whole_answer(llama, extra):
    r = llama[2].chat.completions.create(model="roseinfer", messages=ASK, max_tokens=48, temperature=0,
                                         extra_body=extra)  # fmt: skip
    content, calls, reason = stream_chat(llama[2], messages=ASK, max_tokens=48, temperature=0, extra_body=extra)
    assert (content, calls, reason) == (r.choices[0].message.content, [], r.choices[0].finish_reason)
    if "guided_regex" in extra:
        check(content, reason, "regex", DATE)
    else:
        check(content, reason, "json", PERSON)
    r = httpx.post(llama[0] + "/v1/completions", json={"prompt": "KING.", "max_tokens": 30, "temperature": 0,
                   "stream": True, **extra}, timeout=60)  # fmt: skip
    lines = [json.loads(x[6:]) for x in r.text.split("\n\n") if x.startswith("data: {")]
    text = "".join(c["text"] for line in lines for c in line["choices"])
    check(text, lines[-1]["choices"][0]["finish_reason"], "regex" if "guided_regex" in extra else "json",
          DATE if "guided_regex" in extra else PERSON)  # fmt: skip


@pytest.mark.parametrize("stream", [False, True])
def test_named_and_required_tool_calls_are_forced_and_valid(llama, stream):
    def ask(**kwargs):
        kwargs = {"messages": ASK, "tools": TOOLS, "max_tokens": 60, "temperature": 0, "extra_body": COMPACT} | kwargs
        if stream:
            return stream_chat(llama[2], **kwargs)
        r = llama[2].chat.completions.create(model="roseinfer", **kwargs)
        return r.choices[0].message.content, as_calls(r.choices[0].message), r.choices[0].finish_reason

    content, calls, reason = ask(tool_choice=NAMED)
    assert not content and len(calls) == 1 and calls[0]["name"] == "get_weather"
    jsonschema.validate(json.loads(calls[0]["arguments"]), WEATHER)
    assert reason == "stop"  # a named function: OpenAI's finish_reason stays "stop"
    content, calls, reason = ask(tool_choice="required", parallel_tool_calls=False)
    assert not content and len(calls) == 1 and reason == "tool_calls"  # maxItems 1: the array closes after one
    jsonschema.validate(json.loads(calls[0]["arguments"]), PARAMS[calls[0]["name"]])
    for seed in (1, 2):  # parallel calls allowed: the tiny model goes on calling until max_tokens cuts the array
        content, calls, reason = ask(tool_choice="required", temperature=1.0, seed=seed, max_tokens=70)
        assert not content and calls and reason in ("tool_calls", "length")
        for call in calls:  # every call sent is whole and valid; a call cut short is not sent
            jsonschema.validate(json.loads(call["arguments"]), PARAMS[call["name"]])
        assert all(re.fullmatch(r"chatcmpl-tool-[0-9a-f]{32}", c["id"]) for c in calls)
        assert len({c["id"] for c in calls}) == len(calls)
    assert_engine_empty(llama[1])


def test_stream_and_whole_answer_give_the_same_tool_calls(llama):
    kwargs = {"messages": ASK, "tools": TOOLS, "max_tokens": 60, "temperature": 0, "extra_body": COMPACT}
    for choice in (NAMED, "required"):
        r = llama[2].chat.completions.create(model="roseinfer", tool_choice=choice, **kwargs)
        _, calls, reason = stream_chat(llama[2], tool_choice=choice, **kwargs)
        assert calls
        drop_ids = [{k: v for k, v in c.items() if k != "id"} for c in calls]
        assert drop_ids == [{k: v for k, v in c.items() if k != "id"} for c in as_calls(r.choices[0].message)]
        assert reason == r.choices[0].finish_reason
    r = llama[2].chat.completions.create(model="roseinfer", tool_choice=NAMED, n=2, seed=5, **kwargs | {
        "temperature": 1.0})  # each choice is read on its own  # fmt: skip
    assert [c.index for c in r.choices] == [0, 1]
    for c in r.choices:
        assert len(c.message.tool_calls) == 1 and c.message.tool_calls[0].function.name == "get_weather"
        jsonschema.validate(json.loads(c.message.tool_calls[0].function.arguments), WEATHER)


def test_auto_tool_choice_reads_hermes_calls_the_model_writes(llama):
    """tool_choice "auto" leaves the model free; a text forced to a Hermes call (guided_regex) shows the parser."""
    kwargs = {"messages": ASK, "tools": TOOLS[:1], "max_tokens": 100, "temperature": 0}  # (the tags cost tokens)
    r = llama[2].chat.completions.create(model="roseinfer", **kwargs, extra_body={"guided_regex": HERMES_CALL})
    m = r.choices[0].message
    assert m.content is None and r.choices[0].finish_reason == "tool_calls" and len(m.tool_calls) == 1
    assert m.tool_calls[0].function.name == "get_weather" and m.tool_calls[0].id.startswith("chatcmpl-tool-")
    jsonschema.validate(json.loads(m.tool_calls[0].function.arguments), WEATHER)
    content, calls, reason = stream_chat(llama[2], **kwargs, extra_body={"guided_regex": HERMES_CALL})
    assert not content and reason == "tool_calls" and [(c["name"], c["arguments"]) for c in calls] == [
        (m.tool_calls[0].function.name, m.tool_calls[0].function.arguments)]  # fmt: skip
    free = llama[2].chat.completions.create(model="roseinfer", **kwargs)  # no call in the text: plain content
    assert free.choices[0].message.tool_calls is None and free.choices[0].message.content
    assert free.choices[0].finish_reason in ("stop", "length")


def test_tool_calls_and_tool_results_reach_the_template(llama):
    call = {"id": "chatcmpl-tool-1", "type": "function", "function": {"name": "get_weather",
            "arguments": '{"city": "Rome", "days": 2}'}}  # fmt: skip
    conv = [*ASK, {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "chatcmpl-tool-1", "content": "Rain, then sun."}]  # fmt: skip
    r = httpx.post(llama[0] + "/tokenize", json={"messages": conv, "tools": TOOLS[:1]})
    assert r.status_code == 200, r.text
    parsed = json.loads(json.dumps(conv))
    parsed[1]["tool_calls"][0]["function"]["arguments"] = {"city": "Rome", "days": 2}  # as templates read them
    text, ids = chat_utils.chat_prompt_token_ids(llama[1].engine.tokenizer, parsed, tools=TOOLS[:1])
    assert r.json()["tokens"] == ids and "<tool_response>\nRain, then sun.\n</tool_response>" in text
    assert '{"name": "get_weather", "arguments": {"city": "Rome", "days": 2}}' in text
    r = llama[2].chat.completions.create(model="roseinfer", messages=conv, tools=TOOLS[:1], tool_choice="none",
                                         max_tokens=8, temperature=0)  # fmt: skip
    assert r.choices[0].message.content and r.choices[0].message.tool_calls is None


BAD = [  # route, body, what the message says
    ("chat", {"guided_regex": "(unclosed"}, "guided_regex: structured_outputs.regex cannot be compiled"),
    ("chat", {"guided_json": {"type": "object", "properties": {"a": {"type": "nonsense"}}}}, "guided_json"),
    ("chat", {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 5}}}},
     "response_format"),
    ("chat", {"structured_outputs": {"grammar": "root ::= "}}, "structured_outputs.grammar cannot be compiled"),
    ("chat", {"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice and guided_regex both"),
    ("chat", {"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}},
     "response_format and structured_outputs both"),
    ("chat", {"structured_outputs": {"regex": "a", "choice": ["a"]}}, "multiple are specified"),
    ("chat", {"structured_outputs": {"disable_any_whitespace": True}}, "needs one kind"),
    ("chat", {"guided_whitespace_pattern": " "}, "guided_whitespace_pattern is not supported"),
    ("chat", {"response_format": {"type": "xml"}}, "response_format.type"),
    ("chat", {"response_format": {"type": "json_schema"}}, '"json_schema": {"name"'),
    ("chat", {"tools": []}, "tools must not be an empty list"),
    ("chat", {"tool_choice": "required"}, "needs tools"),
    ("chat", {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "'nope'"),
    ("chat", {"tools": TOOLS, "tool_choice": "maybe"}, "tool_choice"),
    ("chat", {"tools": [{"type": "function"}]}, "tools[0].function is required"),
    ("chat", {"tools": [{"type": "retrieval", "function": {"name": "f"}}]}, "tools[0].type"),
    ("chat", {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}]},
     "JSON schema of an object"),
    ("chat", {"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
     "response_format and tool_choice both"),
    ("chat", {"tools": TOOLS, "tool_choice": NAMED, "guided_regex": "a"}, "guided_regex and tool_choice both"),
    ("chat", {"messages": [*ASK, {"role": "assistant", "tool_calls": [{"type": "function", "function": {
        "name": "f", "arguments": "{not json"}}]}]}, "messages[1].tool_calls[0].function.arguments is not JSON"),
    ("chat", {"messages": [*ASK, {"role": "assistant", "tool_calls": "f"}]}, "messages[1].tool_calls must be a list"),
    ("completions", {"guided_choice": []}, "non-empty list"),
    ("completions", {"response_format": {"type": "json_schema", "json_schema": {"name": "x",
                     "schema": {"type": "object", "properties": {"a": {"type": "nonsense"}}}}}}, "response_format"),
    ("completions", {"guided_regex": "[z-a]"}, "guided_regex"),
]  # fmt: skip


def test_bad_inputs_are_400_in_openai_shape_and_the_server_keeps_serving(llama):
    url, engine, client = llama
    body = {"prompt": "KING.", "max_tokens": 40, "temperature": 0, "stream": True, "guided_json": PERSON, **COMPACT}
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as streaming:  # in flight meanwhile
        lines = streaming.iter_lines()
        first = next(line for line in lines if line.startswith("data: {"))
        for route, bad, match in BAD:
            path = "/v1/chat/completions" if route == "chat" else "/v1/completions"
            base = {"messages": ASK} if route == "chat" else {"prompt": "ROMEO."}
            r = httpx.post(url + path, json=base | {"max_tokens": 8} | bad, timeout=60)
            assert_openai_error(r, 400, match)
        chunks = [json.loads(x[6:]) for x in [first, *lines] if x.startswith("data: {")]
    text = "".join(c["text"] for chunk in chunks for c in chunk["choices"])
    check(text, chunks[-1]["choices"][0]["finish_reason"], "json", PERSON)  # the stream went on, unharmed
    assert_engine_empty(engine)
    want = LLM(LLAMA, **ENGINE).generate(["ROMEO."], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
    r = client.completions.create(model="roseinfer", prompt="ROMEO.", max_tokens=8, temperature=0)
    assert r.choices[0].text == want[0].outputs[0].text
    r = client.chat.completions.create(model="roseinfer", messages=ASK, max_tokens=8, temperature=0,
                                       extra_body={"guided_choice": CHOICES})  # fmt: skip
    assert r.choices[0].message.content in CHOICES


def test_tools_need_a_template_that_renders_them_and_auto_needs_the_flags(gpt2):
    url, engine, client = gpt2
    r = httpx.post(url + "/v1/chat/completions", json={"messages": ASK, "tools": TOOLS, "tool_choice": "required"})
    err = assert_openai_error(r, 400, "does not render tools")
    assert err["param"] == "tools"
    r = httpx.post(url + "/v1/chat/completions", json={"messages": ASK, "tools": TOOLS})  # "auto" by default
    assert_openai_error(r, 400, '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser')
    with pytest.raises(openai.BadRequestError, match="--enable-auto-tool-choice"):
        client.chat.completions.create(model="roseinfer", messages=ASK, tools=TOOLS, tool_choice="auto")
    r = client.chat.completions.create(model="roseinfer", messages=ASK, max_tokens=6, temperature=0,
                                       extra_body={"guided_choice": CHOICES})  # fmt: skip
    assert r.choices[0].message.content in CHOICES
    assert_engine_empty(engine)


def test_structured_output_example_runs():
    """./structured_output_example.sh's program: a real `roseinfer serve`, every answer checked inside."""
    out = subprocess.run([sys.executable, "examples/structured_output_example.py"], cwd=REPO, env=server_env(),
                         capture_output=True, text=True, timeout=180)  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    assert "valid against the schema" in out.stdout and "finish_reason=tool_calls" in out.stdout
    assert "HTTP 400 guided_regex" in out.stdout and "exited with status 0" in out.stdout


def test_serve_flags_for_auto_tool_choice():
    from roseinfer.entrypoints.cli import auto_tool_parser, serve_parser

    parser = serve_parser(argparse.ArgumentParser().add_subparsers())
    assert auto_tool_parser(parser.parse_args([])) is None
    assert auto_tool_parser(parser.parse_args(["--tool-call-parser", "hermes"])) is None  # "auto" stays off
    args = parser.parse_args(["--enable-auto-tool-choice", "--tool-call-parser", "llama3_json"])
    assert auto_tool_parser(args) is ToolParserManager.get_tool_parser("llama3_json")
    with pytest.raises(SystemExit, match="requires --tool-call-parser"):
        auto_tool_parser(parser.parse_args(["--enable-auto-tool-choice"]))
    with pytest.raises(SystemExit):
        parser.parse_args(["--tool-call-parser", "nope"])
