"""Where a Llama step's wall time goes, part by part, and how each part scales from 1 thread to 2 (chapter 20).

    python benchmarks/engine/profile_layers.py --model smollm2-135m --threads 1 2 --json results/20-.../layers.json

torch.profiler (profile_ops.py) adds up each op's own time; this times the parts of every decoder layer with the
wall clock instead, through forward hooks, so a part's time includes everything it waits for:

    qkv / o / gate_up / down     the four linear layers (oneDNN)
    attention                    the layer's self_attn less its linears, norms and rotation: the K/V write and
                                 the attention kernels (decode and prefill)
    input / post norm            RMSNorm, with the residual add from the second call on
    rotary                       q and k rotated
    silu * up                    SwiGLU's gate
    rest of forward              the model's forward less its layers' parts (embedding, the last norm, the Python
                                 between the parts)
    outside forward              the step less the model's forward: logits, sampling, scheduling, outputs

The workload is profile_ops.py's (32 token-id prompts of 16 to 128 random ids, seed 0, 64 greedy tokens each,
max_num_seqs 32, a 4 GiB KV pool). Each thread count gets `--runs` timed runs (hooks on); the table gives the
median of each part.
"""

from __future__ import annotations

import argparse
import collections
import json
import random
import statistics
import time
from pathlib import Path

import torch

from benchmarks import benchmark

PARTS = {  # part name -> the attribute path of a module inside a decoder layer
    "qkv": "self_attn.qkv_proj",
    "o": "self_attn.o_proj",
    "gate_up": "mlp.gate_up_proj",
    "down": "mlp.down_proj",
    "input norm": "input_layernorm",
    "post norm": "post_attention_layernorm",
    "rotary": "self_attn.rotary",
    "silu * up": "mlp.act_fn",
}


class Timers:
    """Wall-clock seconds per named module, summed over calls, through forward pre/post hooks."""

    def __init__(self) -> None:
        self.total: dict[str, float] = collections.defaultdict(float)
        self.started: dict[int, float] = {}

    def watch(self, name: str, module: torch.nn.Module) -> None:
        def pre(mod, args):
            self.started[id(mod)] = time.perf_counter()

        def post(mod, args, out):
            self.total[name] += time.perf_counter() - self.started.pop(id(mod))

        module.register_forward_pre_hook(pre)
        module.register_forward_hook(post)


def profile(llm, prompts, params, runs: int) -> dict[str, float]:
    runner = llm.llm_engine.engine_core.engine_core.model_runner
    model = runner.model
    results = []
    timers = Timers()
    for layer in model.model.layers:
        for name, path in PARTS.items():
            timers.watch(name, layer.get_submodule(path))
        timers.watch("self_attn", layer.self_attn)
    forward = model.forward_paged
    spent = [0.0]

    def timed_forward(*args, **kwargs):
        t = time.perf_counter()
        out = forward(*args, **kwargs)
        spent[0] += time.perf_counter() - t
        return out

    model.forward_paged = timed_forward
    for _ in range(runs):
        timers.total.clear()
        spent[0] = 0.0
        t0 = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        wall = time.perf_counter() - t0
        t = dict(timers.total)
        parts = {name: t.get(name, 0.0) for name in PARTS}
        parts["attention"] = t["self_attn"] - sum(parts[n] for n in ("qkv", "o", "rotary"))  # (Qwen3: + q/k norm)
        parts["rest of forward"] = spent[0] - sum(parts.values())
        parts["outside forward"] = wall - spent[0]
        parts["wall"] = wall
        results.append(parts)
    model.forward_paged = forward
    return {k: statistics.median(r[k] for r in results) for k in results[0]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--custom-ops", default="auto", help="auto | native | compile (the engine's setting)")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    from roseinfer import LLM, SamplingParams

    model_dir = benchmark.resolve_model(args.model, benchmark.REPO / ".cache" / "random-models")
    llm = LLM(str(model_dir), device="cpu", dtype="float32", max_num_seqs=32, kv_cache_memory=4 * 2**30,
              custom_ops=args.custom_ops)  # fmt: skip
    rng = random.Random(0)
    vocab = llm.llm_engine.config.model_config.vocab_size
    prompts = [[rng.randrange(vocab) for _ in range(rng.randint(16, 128))] for _ in range(32)]
    params = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True)
    by_threads = {}
    for threads in args.threads:
        torch.set_num_threads(threads)
        llm.generate(prompts[:4], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True), use_tqdm=False)
        by_threads[threads] = profile(llm, prompts, params, args.runs)
    cols = args.threads
    print(f"{args.model}, custom_ops={args.custom_ops}, {32 * 64} tokens, median of {args.runs} runs "
          f"({benchmark.device_name(torch.device('cpu')).split(' (')[0]})")  # fmt: skip
    head = "".join(f"{f'{t} thread' + ('s' if t > 1 else '') + ' ms':>16}{'share':>7}" for t in cols)
    scale = f"{'x ' + str(cols[0]) + '->' + str(cols[-1]):>9}" if len(cols) > 1 else ""
    print(f"{'part':<18}{head}{scale}")
    for part in by_threads[cols[0]]:
        cells = ""
        for t in cols:
            v, wall = by_threads[t][part], by_threads[t]["wall"]
            cells += f"{v * 1e3:16.0f}{100 * v / wall:6.1f}%"
        last = by_threads[cols[-1]][part]  # 0 for "rotary" where the K/V write's pass rotates (it is in attention)
        ratio = by_threads[cols[0]][part] / last if len(cols) > 1 and last else None
        print(f"{part:<18}{cells}{f'{ratio:9.2f}' if ratio else ''}")
    tok_s = {t: 32 * 64 / by_threads[t]["wall"] for t in cols}
    print("tok/s " + ", ".join(f"{t} thread(s): {v:.1f}" for t, v in tok_s.items()))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(dict(model=args.model, custom_ops=args.custom_ops, runs=args.runs,
                                             seconds=by_threads, tok_s=tok_s), indent=1))  # fmt: skip


if __name__ == "__main__":
    main()
