"""Stage 05: batched decode (many requests per forward), vectorised sampling, the benchmark harness."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import PROMPTS, REPO, greedy_ids, hf_greedy
from test_02_kv_cache import sampling_tensors

from roseinfer import SamplingParams
from roseinfer.sample.sampler import sample

LONG = "Enter the King and Queen, with Lords and Attendants.\n\nKing.\n" + "O, speak again, bright angel! " * 30
VARIED = PROMPTS + [LONG]  # 1 to ~220 tokens


def test_batched_greedy_equals_sequential_equals_hf(llm, tokenizer, hf_model):
    eng = llm.llm_engine
    eng.trace = []
    try:
        for i, prompt in enumerate(VARIED):
            eng.add_request(str(i), prompt, SamplingParams(temperature=0, max_tokens=32))
        out = {}
        while eng.has_unfinished_requests():
            for o in eng.step():
                if o.finished:
                    out[o.request_id] = o.token_ids
        trace = eng.trace
    finally:
        eng.trace = None
    # they really decoded together: a step in which every request fed exactly one token
    assert any(len(t["ran"]) == len(VARIED) and set(t["num_scheduled_tokens"].values()) == {1} for t in trace)
    for i, prompt in enumerate(VARIED):
        ids = tokenizer.encode(prompt)
        assert out[str(i)] == greedy_ids(llm, prompt, 32), prompt[:30]
        assert out[str(i)] == hf_greedy(hf_model, ids, 32), prompt[:30]


def test_seeded_sampling_is_the_same_alone_or_in_a_batch(llm):
    params = [SamplingParams(temperature=1.0, top_k=50, top_p=0.95, max_tokens=24, seed=s) for s in range(4)]
    prompts = ["Romeo.\n", LONG, "Nurse.\n", "KING."]
    together = llm.generate(prompts, params, use_tqdm=False)
    for prompt, p, out in zip(prompts, params, together, strict=True):
        alone = llm.generate(prompt, p, use_tqdm=False)[0]
        assert out.token_ids == alone.token_ids and len(out.token_ids) > 0


def _reference_row(logits: torch.Tensor, p: SamplingParams, q: torch.Tensor) -> int:
    """One row, written the slow obvious way: filter the distribution, then the exponential race
    argmax_i p_i / q_i over the kept tokens (q_i ~ Exp(1): token i wins with probability p_i / sum p)."""
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
    return max(kept, key=lambda i: probs[i].item() / q[i].item())


def test_sampler_matches_a_per_row_reference():
    g = torch.Generator().manual_seed(0)
    B, V = 24, 64
    logits = torch.randn(B, V, generator=g) * 3
    choices = [(0.0, -1, 1.0), (1.0, -1, 1.0), (0.7, 5, 1.0), (1.3, -1, 0.6), (1.0, 10, 0.8), (2.0, 1, 1.0)]
    params = [SamplingParams(temperature=t, top_k=k, top_p=q, seed=100 + i) for i, (t, k, q) in
              enumerate(choices * (B // len(choices)))]  # fmt: skip
    got = sample(logits, sampling_tensors(params, V))
    for i, p in enumerate(params):
        q = torch.empty(V).exponential_(generator=p.make_generator())  # the numbers the sampler drew for this row
        assert got[i].item() == _reference_row(logits[i], p, q), (i, p)


@pytest.fixture(scope="module")
def bench():
    from benchmarks import benchmark

    return benchmark


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
