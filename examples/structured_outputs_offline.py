"""Stage 21: the same prompt with and without a constraint, through `LLM`, on the bundled tiny Llama (greedy).

    python examples/structured_outputs_offline.py

1. No constraint: the model writes what it was trained on (Shakespeare).
2. Each kind of constraint: a JSON schema, a regex, a choice, an EBNF grammar and any JSON object. The text
   follows it, whatever the model would rather write; the grammar's end is a stop ("stop"), not max_tokens.
3. One JSON schema without bounds on its integer: a grammar constrains the form, not the sense, and a tiny
   model happily writes digits until max_tokens.
4. What the engine did meanwhile: the compiled grammars it holds and the rows of the last constrained step.
"""

from __future__ import annotations

import json

from roseinfer import LLM, SamplingParams, StructuredOutputsParams

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
    },
    "required": ["name", "age"],
}
CONSTRAINTS = {
    "json schema": StructuredOutputsParams(json=PERSON, disable_any_whitespace=True),
    "regex": StructuredOutputsParams(regex=r"\d{4}-\d{2}-\d{2}"),
    "choice": StructuredOutputsParams(choice=["yes", "no", "maybe"]),
    "grammar": StructuredOutputsParams(grammar='root ::= "(" [a-z]{1,8} ("," [a-z]{1,8}){0,2} ")"'),
    "json object": StructuredOutputsParams(json_object=True, disable_any_whitespace=True),
}


def main() -> None:
    llm = LLM("roseinfer/models/tiny-llama-shakespeare")
    prompt = "Give me a person as JSON:"
    print(f"prompt: {prompt!r}\n")
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)[0].outputs[0]
    print(f"{'no constraint':<13} {out.finish_reason:<6} {out.text!r}")
    params = [SamplingParams(temperature=0, max_tokens=40, structured_outputs=so) for so in CONSTRAINTS.values()]
    outs = llm.generate([prompt] * len(params), params, use_tqdm=False)  # one batch, five grammars
    for name, o in zip(CONSTRAINTS, outs, strict=True):
        print(f"{name:<13} {o.outputs[0].finish_reason:<6} {o.outputs[0].text!r}")
    print("\nparsed:", json.loads(outs[0].outputs[0].text))
    unbounded = {**PERSON, "properties": {**PERSON["properties"], "age": {"type": "integer"}}}
    so = StructuredOutputsParams(json=unbounded, disable_any_whitespace=True)
    o = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=40, structured_outputs=so), use_tqdm=False)
    print(f"\nno maximum on the age: {o[0].outputs[0].finish_reason} {o[0].outputs[0].text!r}")
    manager = llm.llm_engine.engine_core.engine_core.structured_output_manager
    print(f"\ncompiled grammars held: {len(manager.backend.cache)} (one per distinct constraint)")
    print(f"bitmask words per row: {(manager.backend.vocab_size + 31) // 32} for a vocabulary of "
          f"{manager.backend.vocab_size} tokens")  # fmt: skip


if __name__ == "__main__":
    main()
