"""Structured outputs and tool calls through the OpenAI API (stage 21): a JSON schema, a regex, a choice, any JSON
object, and tool calls, against `roseinfer serve` of the bundled tiny Llama, with the official `openai` client.

    ./structured_output_example.sh
    ./structured_output_example.sh --model path/to/llama-dir

Starts `python -m roseinfer serve --enable-auto-tool-choice --tool-call-parser hermes` on a free port of
127.0.0.1, sends each request greedily (the same text on every run), checks each answer (jsonschema, a regex
fullmatch, the list of choices), prints it, and stops the server with SIGTERM.

The tiny model was trained on Shakespeare only: it knows no JSON, so everything JSON-shaped below comes from the
constraint, which masks every token the grammar forbids before sampling. Left free between JSON tokens, it would
write newlines until max_tokens, so the JSON requests ask for the compact form, vLLM's
`structured_outputs: {"disable_any_whitespace": true}`.
"""

from __future__ import annotations

import argparse
import json
import re
import signal
import subprocess
import sys

import jsonschema
import openai

from benchmarks.common import free_port, start_server

LLAMA = "roseinfer/models/tiny-llama-shakespeare"
COMPACT = {"structured_outputs": {"disable_any_whitespace": True}}
CHARACTER = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 16},
        "age": {"type": "integer", "minimum": 1, "maximum": 99},
        "house": {"enum": ["Montague", "Capulet"]},
    },
    "required": ["name", "age", "house"],
    "additionalProperties": False,
}
WEATHER = {"type": "object", "properties": {"city": {"enum": ["Verona", "Mantua"]}, "days": {"type": "integer",
           "minimum": 1, "maximum": 7}}, "required": ["city", "days"], "additionalProperties": False}  # fmt: skip
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "forecast", "parameters": WEATHER}}]


def closing(text: str) -> str:
    """What closes a JSON object cut short (a string key, a string value, a number ...)."""
    for end in ("", '"}', '":0}', "}", "0}"):
        try:
            if isinstance(json.loads(text + end), dict):
                return end
        except json.JSONDecodeError:
            pass
    raise AssertionError(f"not the start of a JSON object: {text!r}")


def start(model: str) -> tuple[subprocess.Popen, str, list[str]]:
    port = free_port()
    cmd = [sys.executable, "-m", "roseinfer", "serve", "--model", model, "--port", str(port), "--device", "cpu",
           "--enable-auto-tool-choice", "--tool-call-parser", "hermes"]  # fmt: skip
    server = start_server(cmd, port, timeout=120, stderr=subprocess.DEVNULL)  # this checkout's roseinfer, offline
    return server, f"http://127.0.0.1:{port}", cmd


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=LLAMA)
    args = ap.parse_args()
    server, base, cmd = start(args.model)
    try:
        print(f"$ python {' '.join(cmd[1:])}\n")
        client = openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0)
        ask = [{"role": "user", "content": "Who art thou?"}]

        def chat(**kwargs):
            kwargs = {"max_tokens": 60, "temperature": 0} | kwargs
            r = client.chat.completions.create(model="roseinfer", messages=ask, **kwargs)
            return r.choices[0]

        schema = {"name": "character", "schema": CHARACTER, "strict": True}
        c = chat(response_format={"type": "json_schema", "json_schema": schema}, extra_body=COMPACT)
        jsonschema.validate(json.loads(c.message.content), CHARACTER)
        print(f"1. response_format json_schema (a character): {c.message.content}")
        print(f"   valid against the schema (jsonschema); finish_reason={c.finish_reason}")

        c = chat(extra_body={"guided_regex": r"\d{4}-\d{2}-\d{2}"})
        assert re.fullmatch(r"\d{4}-\d{2}-\d{2}", c.message.content)
        print(f"\n2. guided_regex \\d{{4}}-\\d{{2}}-\\d{{2}} (a date): {c.message.content!r}")

        choices = ["Montague", "Capulet", "neither"]
        c = chat(extra_body={"guided_choice": choices})
        assert c.message.content in choices
        print(f"\n3. guided_choice {choices}: {c.message.content!r}")

        c = chat(response_format={"type": "json_object"}, max_tokens=24, extra_body=COMPACT)
        print(f"\n4. response_format json_object: {c.message.content!r}  finish_reason={c.finish_reason}")
        end = closing(c.message.content)
        print("   any object: the model opens a key and fills it with verse until max_tokens cuts it; what it wrote")
        print(f"   is the start of a JSON object: adding {end!r} closes it")

        named = {"type": "function", "function": {"name": "get_weather"}}
        c = chat(tools=TOOLS, tool_choice=named, extra_body=COMPACT)
        call = c.message.tool_calls[0]
        jsonschema.validate(json.loads(call.function.arguments), WEATHER)
        assert re.fullmatch(r"chatcmpl-tool-[0-9a-f]{32}", call.id)  # a fresh one per call
        print(f"\n5. tool_choice get_weather: {call.function.name}({call.function.arguments})  "
              "id=chatcmpl-tool-<32 hex digits>")  # fmt: skip
        print(f"   content={c.message.content!r}  finish_reason={c.finish_reason}")

        c = chat(tools=TOOLS, tool_choice="required", parallel_tool_calls=False, extra_body=COMPACT)
        calls = [f"{t.function.name}({t.function.arguments})" for t in c.message.tool_calls]
        for t in c.message.tool_calls:
            jsonschema.validate(json.loads(t.function.arguments), WEATHER)
        print(f"\n6. tool_choice required, parallel_tool_calls false: {calls}  finish_reason={c.finish_reason}")

        c = chat(tools=TOOLS, max_tokens=16)
        print(f"\n7. tool_choice auto (hermes parser): the tiny model writes no <tool_call>, so it is content: "
              f"{c.message.content!r}, tool_calls={c.message.tool_calls}")  # fmt: skip

        try:
            chat(extra_body={"guided_regex": "(unclosed"})
        except openai.BadRequestError as e:
            print(f"\n8. a regex that does not compile: HTTP {e.status_code} {e.body['message']}")
    finally:
        server.send_signal(signal.SIGTERM)
        print(f"\nSIGTERM: the server exited with status {server.wait(timeout=60)}")


if __name__ == "__main__":
    main()
