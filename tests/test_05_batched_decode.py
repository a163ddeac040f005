"""Stage 05: batched decode (padding, masks, per-row positions), vectorised sampling, the benchmark harness."""

from __future__ import annotations

import importlib.util
import json
import sys

import pytest
import torch
from conftest import PROMPTS, REPO, hf_greedy

from roseinfer import SamplingParams
from roseinfer.sampling import sample
from roseinfer.scheduler import OfflineScheduler

LONG = "Enter the King and Queen, with Lords and Attendants.\n\nKing.\n" + "O, speak again, bright angel! " * 30
VARIED = PROMPTS + [LONG]  # 1 to ~220 tokens


def test_batched_greedy_equals_sequential_equals_hf(engine, hf_model):
    sched = OfflineScheduler(engine, trace=True)
    for prompt in VARIED:
        sched.add_request(prompt, SamplingParams(temperature=0, max_tokens=32))
    out = sched.run()
    assert max(len(t["ran"]) for t in sched.trace) == len(VARIED)  # they really decoded together
    for rid, prompt in zip(out, VARIED, strict=True):
        ids = engine.tokenizer.encode(prompt)
        solo = engine.generate_ids(ids, max_new_tokens=32)
        assert out[rid].token_ids == solo, prompt[:30]
        assert out[rid].token_ids == hf_greedy(hf_model, ids, 32), prompt[:30]


def test_seeded_sampling_is_the_same_alone_or_in_a_batch(engine):
    params = [SamplingParams(temperature=1.0, top_k=50, top_p=0.95, max_tokens=24, seed=s) for s in range(4)]
    prompts = ["Romeo.\n", LONG, "Nurse.\n", "KING."]
    sched = OfflineScheduler(engine)
    for prompt, p in zip(prompts, params, strict=True):
        sched.add_request(prompt, p)
    together = sched.run()
    for rid, prompt, p in zip(together, prompts, params, strict=True):
        alone = list(engine.token_stream(engine.tokenizer.encode(prompt), p))
        assert together[rid].token_ids == alone


def _reference_row(logits: torch.Tensor, p: SamplingParams, u: float) -> int:
    """One row, written the slow obvious way: filter, renormalise, walk the CDF."""
    if p.temperature == 0:
        return int(logits.argmax())
    probs = torch.softmax(logits.double() / p.temperature, dim=-1)
    order = sorted(range(len(probs)), key=lambda i: -probs[i].item())
    kept, mass = [], 0.0
    for i in order:
        if (p.top_k > 0 and len(kept) >= p.top_k) or mass >= p.top_p:
            break
        kept.append(i)
        mass += probs[i].item()
    total = sum(probs[i].item() for i in kept)
    acc = 0.0
    for i in kept:
        acc += probs[i].item() / total
        if acc >= u:
            return i
    return kept[-1]


def test_sampler_matches_a_per_row_reference():
    g = torch.Generator().manual_seed(0)
    B, V = 24, 64
    logits = torch.randn(B, V, generator=g) * 3
    choices = [(0.0, -1, 1.0), (1.0, -1, 1.0), (0.7, 5, 1.0), (1.3, -1, 0.6), (1.0, 10, 0.8), (2.0, 1, 1.0)]
    params = [SamplingParams(temperature=t, top_k=k, top_p=q, seed=100 + i) for i, (t, k, q) in
              enumerate(choices * (B // len(choices)))]  # fmt: skip
    got = sample(logits, params, [p.make_generator() for p in params])
    for i, p in enumerate(params):
        u = torch.rand(1, generator=p.make_generator()).item()  # the number the sampler drew for this row
        assert got[i].item() == _reference_row(logits[i], p, u), (i, p)


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("roseinfer_benchmark", REPO / "scripts" / "benchmark.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_benchmark_runs_end_to_end_on_a_tiny_workload(bench, tmp_path):
    out = tmp_path / "bench.json"
    rc = bench.main(["--workload", "tiny", "--threads", "1", "--json", str(out)])
    assert rc == 0
    report = json.loads(out.read_text())
    assert set(report) >= {"device", "model", "workload", "engines"}
    wl = report["workload"]
    assert set(report["engines"]) == {"roseinfer", "hf-generate", "hf-cb", "dense-limit"}  # dense-limit: stage 09
    for name, r in report["engines"].items():
        assert r["tokens_ok"] is True, name
        assert r["output_tokens"] == wl["total_output_tokens"] and r["requests"] == wl["num_requests"], name
        assert r["output_tokens_per_s"] > 0, name


def test_benchmark_workload_is_seeded(bench):
    args = bench.parse_args(["--workload", "small", "--num-requests", "20", "--seed", "3"])
    a = bench.make_workload(args, 512, 4096, REPO)
    b = bench.make_workload(args, 512, 4096, REPO)
    assert a.prompts == b.prompts and a.output_lens == b.output_lens
    assert all(16 <= len(p) <= 128 and max(p) < 4095 for p in a.prompts)  # never the EOS id
    with pytest.raises(SystemExit):  # does not fit a 128-token context
        bench.make_workload(args, 128, 4096, REPO)
