"""The `ct2` engine's worker: CTranslate2 runs the workload that benchmarks/engine/bench_engines.py hands it.

Runs under .venv-ct2's python (scripts/setup_peer_ct2.sh), never imported by the benchmark itself:

    .venv-ct2/bin/python benchmarks/peers/ct2.py REQUEST.json

REQUEST.json: {"model": converted CT2 dir, "device": "cpu"|"cuda", "compute_type": "float32"|..., "threads": N,
"batch_size": B, "prompts": [[token ids]], "output_lens": [n]}. CTranslate2 has no continuous batching: the
requests go in static batches of B (in order, as hf-generate's), each batch runs to its longest output and only
the requested tokens count. Greedy (sampling_topk=1), and EOS is an ordinary token (end_token=[]). Only the
generation is timed (loading and a tiny warm-up are not). The last stdout line is the JSON
{"ids": [[...]], "seconds": s, "extras": {...}}.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path


def load_vocabulary(model_dir: Path) -> list[str]:
    """The converted model's tokens, by id: generate_batch takes its start tokens as strings."""
    if (model_dir / "vocabulary.json").exists():
        return json.loads((model_dir / "vocabulary.json").read_text())
    return (model_dir / "vocabulary.txt").read_text(encoding="utf-8").split("\n")[:-1]


def main() -> None:
    req = json.loads(Path(sys.argv[1]).read_text())
    import ctranslate2

    model_dir = Path(req["model"])
    gen = ctranslate2.Generator(str(model_dir), device=req["device"], compute_type=req["compute_type"],
                                intra_threads=req["threads"], inter_threads=1)  # fmt: skip
    vocab = load_vocabulary(model_dir)

    def generate(prompts: list[list[int]], lens: list[int]) -> list[list[int]]:
        n = max(lens)
        results = gen.generate_batch(
            [[vocab[i] for i in p] for p in prompts],
            max_length=n,  # new tokens only: with include_prompt_in_result=False the prompt is not counted
            include_prompt_in_result=False,  # the prompt goes through the decoder at once (a prefill)
            end_token=[],  # no token ends a sequence: each runs max_length steps (EOS is an ordinary token)
            sampling_topk=1,  # greedy
            beam_size=1,
        )
        return [r.sequences_ids[0][:k] for r, k in zip(results, lens, strict=True)]

    generate([[1, 2, 3], [4, 5]], [2, 2])  # warm-up
    prompts, lens, bs = req["prompts"], req["output_lens"], req["batch_size"]
    t0 = time.perf_counter()
    ids = []
    for i in range(0, len(prompts), bs):
        ids += generate(prompts[i : i + bs], lens[i : i + bs])
    secs = time.perf_counter() - t0
    extras = {"peer_version": f"ctranslate2 {ctranslate2.__version__}"}
    print(json.dumps({"ids": ids, "seconds": secs, "extras": extras}), flush=True)


if __name__ == "__main__":
    main()
