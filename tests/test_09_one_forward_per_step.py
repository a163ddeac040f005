"""Stage 09: one forward per step: a token budget, chunked prefill, the model runner, the mixed-batch attention."""

from __future__ import annotations

import pytest
import torch
from conftest import PROMPTS, core, greedy_ids, hf_greedy, run_python

from roseinfer import LLM, LLMEngine, SamplingParams
from roseinfer.attention import write_kv
from roseinfer.attention.reference import attention_reference
from roseinfer.attention.sdpa import attention_sdpa, paged_decode_sdpa, write_kv_flat
from roseinfer.worker.model_runner import ModelRunner

NEW = 24
GREEDY = SamplingParams(temperature=0, max_tokens=NEW)
LONG = "".join(PROMPTS) * 2  # ~190 tokens: many chunks, many blocks


@pytest.fixture(scope="module")
def prompts_ids(tokenizer):
    return [tokenizer.encode(p) for p in [*PROMPTS, LONG]]


@pytest.fixture(scope="module")
def hf_outputs(hf_model, prompts_ids):
    return [hf_greedy(hf_model, ids, NEW) for ids in prompts_ids]


def run_all(eng: LLMEngine) -> dict[str, list[int]]:
    done = {}
    while eng.has_unfinished_requests():
        done.update({o.request_id: o.token_ids for o in eng.step() if o.finished})
    return done


@pytest.mark.parametrize("budget", [1, 7, 16, 64, 4096])
def test_greedy_equals_hf_for_every_token_budget(budget, prompts_ids, hf_outputs):
    """Chunks that end inside a block (7), at block boundaries (16, 64) and whole prompts (4096)."""
    eng = LLMEngine(device="cpu", dtype="float32", block_size=16, max_num_batched_tokens=budget)
    eng.trace = []
    for i, ids in enumerate(prompts_ids):  # all at once: batched with each other
        eng.add_request(str(i), ids, GREEDY)
    done = run_all(eng)
    for i in range(len(prompts_ids)):
        assert done[str(i)] == hf_outputs[i], i
    assert max(sum(t["num_scheduled_tokens"].values()) for t in eng.trace) <= budget
    assert core(eng).kv_cache_manager.stats().used_blocks == 0
    alone = LLMEngine(device="cpu", dtype="float32", block_size=16, max_num_batched_tokens=budget)
    alone.add_request("long", prompts_ids[-1], GREEDY)  # the long prompt alone, in chunks of `budget`
    assert run_all(alone)["long"] == hf_outputs[-1]


def test_a_long_prompt_is_prefilled_in_chunks_while_others_keep_decoding(llm, tokenizer):
    eng = LLMEngine(device="cpu", dtype="float32", block_size=8, max_num_batched_tokens=16)
    eng.trace = []
    p = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    eng.add_request("a", "Romeo.\n", p)
    eng.add_request("b", "Juliet.\n", p)
    for _ in range(3):
        eng.step()  # a and b are decoding
    long_ids = tokenizer.encode(LONG)[:100]
    eng.add_request("long", long_ids, p)
    outputs = []
    while "long" in core(eng).scheduler.requests and not core(eng).scheduler.requests["long"].output_token_ids:
        outputs.append({o.request_id for o in eng.step()})
    chunks = [t["num_scheduled_tokens"] for t in eng.trace[3:]]
    assert all(c["a"] == 1 and c["b"] == 1 for c in chunks)  # running requests never stall
    assert [c["long"] for c in chunks] == [14] * 7 + [2]  # 100 prompt tokens in chunks of what is left
    assert all(outs == {"a", "b"} for outs in outputs[:-1]) and outputs[-1] == {"a", "b", "long"}
    done = run_all(eng)
    assert done["long"] == greedy_ids(llm, long_ids, 30, ignore_eos=True)  # each as it runs alone
    assert done["a"] == greedy_ids(llm, "Romeo.\n", 30, ignore_eos=True)


def test_one_forward_per_step_and_logits_only_where_a_token_is_sampled(monkeypatch):
    eng = LLMEngine(device="cpu", dtype="float32", max_num_batched_tokens=20)
    model = core(eng).model_runner.model
    calls, rows = [], []
    forward, logits = model.forward_paged, model.compute_logits
    monkeypatch.setattr(model, "forward_paged", lambda *a: calls.append(a[0].shape[0]) or forward(*a))
    monkeypatch.setattr(model, "compute_logits", lambda h: rows.append(h.shape[0]) or logits(h))
    for i, prompt in enumerate(PROMPTS):
        eng.add_request(str(i), prompt, GREEDY)
    steps = 0
    while eng.has_unfinished_requests():
        produced = eng.step()
        steps += 1
        assert len(calls) == len(rows) == steps  # exactly one forward and one LM-head call per step
        assert rows[-1] == len(produced)  # the LM head only ran for requests that got a token
        assert calls[-1] <= 20


def test_single_request_path_goes_through_the_scheduler_and_the_runner(llm, tokenizer, monkeypatch):
    seen = []
    execute = ModelRunner.execute_model
    monkeypatch.setattr(ModelRunner, "execute_model", lambda self, s: seen.append(s) or execute(self, s))
    ids = greedy_ids(llm, "Romeo.\n", 5)
    assert len(seen) == len(ids) == 5
    assert seen[0].num_scheduled_tokens == {"0": len(tokenizer.encode("Romeo.\n"))}  # the prefill step
    assert all(s.num_scheduled_tokens == {"0": 1} for s in seen[1:])  # then one decode token each


def test_seeded_sampling_does_not_depend_on_the_budget():
    """A partial prompt chunk samples nothing, so a request's generator advances exactly once per token."""
    p = SamplingParams(temperature=0.9, top_k=40, seed=5, max_tokens=20)
    texts = []
    for budget in (3, 4096):
        llm = LLM(device="cpu", max_num_batched_tokens=budget)
        texts.append([o.token_ids for o in llm.generate(PROMPTS[:4], p, use_tqdm=False)])
    assert texts[0] == texts[1]


def test_budget_smaller_than_a_block_or_than_max_num_seqs_still_finishes(llm):
    eng = LLMEngine(device="cpu", dtype="float32", block_size=4, num_blocks=64, max_num_seqs=4,
                    max_num_batched_tokens=2)  # fmt: skip
    eng.trace = []
    prompts = ["Romeo.\n", "Juliet.\n", "Nurse.\n", "Friar.\n", "Tybalt.\n"]
    p = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        eng.add_request(str(i), prompt, p)
    done = run_all(eng)
    assert all(len(t["ran"]) <= 2 and sum(t["num_scheduled_tokens"].values()) <= 2 for t in eng.trace)
    for i, prompt in enumerate(prompts):
        assert done[str(i)] == greedy_ids(llm, prompt, 6, ignore_eos=True)
    assert core(eng).kv_cache_manager.stats().used_blocks == 0


@pytest.mark.parametrize("bad", [0, -1, 1.5, "64", None])
def test_bad_token_budget_is_a_clear_error(bad):
    if bad is None:  # None means "the default", not an error
        assert core(LLMEngine(device="cpu", max_num_batched_tokens=None)).scheduler.max_num_batched_tokens == 2048
        return
    with pytest.raises((TypeError, ValueError), match="max_num_batched_tokens"):  # a wrong type is a TypeError
        LLMEngine(device="cpu", max_num_batched_tokens=bad)


def test_without_chunked_prefill_the_budget_must_hold_a_whole_context(tokenizer):
    with pytest.raises(ValueError, match="enable_chunked_prefill"):
        LLMEngine(device="cpu", max_num_batched_tokens=64, enable_chunked_prefill=False)
    eng = LLMEngine(device="cpu", dtype="float32", enable_chunked_prefill=False, max_num_batched_tokens=512)
    eng.trace = []
    long_ids = tokenizer.encode(LONG)
    prompts = [long_ids[i:] for i in range(4)]  # four different long prompts (stage 10: nothing shared)
    for i, prompt in enumerate(prompts):
        eng.add_request(str(i), prompt, SamplingParams(temperature=0, max_tokens=4))
    run_all(eng)
    steps = [t["num_scheduled_tokens"] for t in eng.trace]
    assert all(n in (1, len(prompts[int(r)])) for step in steps for r, n in step.items())  # never a partial prompt
    assert max(sum(step.values()) for step in steps) <= 512


def finish_by_hand(eng: LLMEngine, so) -> None:
    """The rest of `LLMEngine.step` for a SchedulerOutput the test got from `core(eng).scheduler.schedule()`."""
    outputs, stopped = eng.output_processor.process_outputs(
        core(eng).scheduler.update_from_output(so, core(eng).model_runner.execute_model(so))
    )
    assert outputs and not stopped


def test_scheduler_output_names_new_resumed_and_preempted_requests(llm):
    eng = LLMEngine(device="cpu", block_size=4, num_blocks=6, max_num_seqs=4)
    p = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    for rid in ("a", "b", "c", "d"):
        eng.add_request(rid, list(range(1, 5)), p)  # one full block each
    first = core(eng).scheduler.schedule()
    assert [r.req_id for r in first.scheduled_new_reqs] == ["a", "b", "c", "d"]
    assert first.total_num_scheduled_tokens == 16 and first.scheduled_cached_reqs.req_ids == []
    tables = {r.req_id: r.block_ids for r in first.scheduled_new_reqs}  # new requests: their whole table
    assert all(len(t) == 1 for t in tables.values())
    finish_by_hand(eng, first)
    second = core(eng).scheduler.schedule()  # each needs a 2nd block, 2 are free: a, b take them, c preempts d
    assert second.preempted_req_ids == ["d"] and second.scheduled_new_reqs == []
    assert list(second.num_scheduled_tokens) == ["a", "b", "c"] and second.total_num_scheduled_tokens == 3
    c = second.scheduled_cached_reqs  # requests the runner knows: only what changed, their tables' new tails
    assert c.req_ids == ["a", "b", "c"] and c.num_computed_tokens == [4, 4, 4]
    assert c.resumed_from_preemption == [False] * 3
    assert [(j, len(ids)) for j, ids in c.new_block_ids] == [(1, 1)] * 3  # each table grew by one block at index 1
    assert c.new_block_ids[2] == (1, tables["d"])  # c's new block is the one d gave back
    held = {b for t in tables.values() for b in t}
    assert not held & {c.new_block_ids[0][1][0], c.new_block_ids[1][1][0]}  # a and b took the two free ones
    finish_by_hand(eng, second)
    eng.trace = []
    done = run_all(eng)
    assert any(t["scheduled_resumed_reqs"] == ["d"] for t in eng.trace)  # d comes back, as resumed, not new
    assert all("d" not in t["scheduled_new_reqs"] for t in eng.trace)
    assert done["d"] == greedy_ids(llm, list(range(1, 5)), 12, ignore_eos=True)
    assert core(eng).kv_cache_manager.stats().used_blocks == 0


# ---- the attention paths against the oracle ---------------------------------------------------------
def _random_batch(seed: int, block_size: int, H: int = 3, D: int = 16, dtype=torch.float32):
    """A mixed batch: decodes first, then fresh prompts and later chunks; finite garbage in unused slots."""
    g = torch.Generator().manual_seed(seed)
    r = lambda lo, hi: int(torch.randint(lo, hi + 1, (1,), generator=g))
    num_blocks = 64
    k_cache = torch.randn(num_blocks, block_size, H, D, generator=g).to(dtype) * 30  # garbage, but finite
    v_cache = torch.randn(num_blocks, block_size, H, D, generator=g).to(dtype) * 30
    free = torch.randperm(num_blocks, generator=g).tolist()
    decodes = [(1, r(1, 40)) for _ in range(r(0, 4))]
    chunks = [(r(1, 20), 0) for _ in range(r(0, 2))] + [(r(1, 20), r(1, 30)) for _ in range(r(0, 2))]
    reqs = decodes + [(q, q + ctx) for q, ctx in chunks] or [(1, 1)]
    q_lens, seq_lens = [q for q, _ in reqs], [L for _, L in reqs]
    tables, news = [], []
    for q_len, L in reqs:
        table = [free.pop() for _ in range(-(-L // block_size))]
        pos = torch.arange(L)
        slots = torch.tensor(table)[pos // block_size] * block_size + pos % block_size
        ks, vs = torch.randn(L, H, D, generator=g).to(dtype), torch.randn(L, H, D, generator=g).to(dtype)
        write_kv(ks, vs, k_cache, v_cache, slots)  # the whole context, the new tokens' K/V included
        tables.append(table)
        news.append((ks[L - q_len :], vs[L - q_len :]))
    width = max(map(len, tables))
    block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    starts = [0]
    for n in q_lens:
        starts.append(starts[-1] + n)
    from roseinfer.attention import SDPA_BACKEND, AttentionMetadata

    meta = AttentionMetadata(
        slot_mapping=torch.zeros(starts[-1], dtype=torch.long), query_start_loc=torch.tensor(starts, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32), block_tables=block_tables, num_decodes=len(decodes),
        max_query_len=max(q_lens), query_start_loc_cpu=starts, seq_lens_cpu=seq_lens, backend=SDPA_BACKEND,
    )  # fmt: skip
    q = torch.randn(starts[-1], H, D, generator=g).to(dtype)
    key, value = torch.cat([k for k, _ in news]), torch.cat([v for _, v in news])
    return q, key, value, k_cache, v_cache, meta


@pytest.mark.parametrize("block_size", [4, 8, 16, 32])
@pytest.mark.parametrize("seed", range(6))
def test_sdpa_path_matches_the_reference_on_random_mixed_batches(block_size, seed):
    q, key, value, k_cache, v_cache, meta = _random_batch(seed * 10 + block_size, block_size)
    scale = q.shape[-1] ** -0.5
    ref = attention_reference(q, k_cache, v_cache, meta.block_tables, meta.query_start_loc, meta.seq_lens, scale)
    out = attention_sdpa(q, key, value, k_cache, v_cache, meta, scale)
    assert torch.allclose(out, ref, atol=1e-5), (out - ref).abs().max()
    d = meta.num_decodes
    if d:  # the decode part on its own too
        dec = paged_decode_sdpa(q[:d], k_cache, v_cache, meta.block_tables[:d], meta.seq_lens[:d], scale)
        assert torch.allclose(dec, ref[:d], atol=1e-5)


def test_decode_rows_are_cut_into_runs_of_similar_length():
    from roseinfer.attention.sdpa import decode_runs

    blocks = [16, 16, 15, 14, 8, 8, 7, 7, 7, 6, 2, 2, 1, 1, 1, 1]  # the docstring's example
    assert decode_runs([16 * n for n in blocks], 16) == [(0, 4, 16), (4, 10, 8), (10, 16, 2)]
    assert decode_runs([5, 5, 3], 16) == [(0, 3, 1)] and decode_runs([], 16) == []


def test_flat_kv_write_equals_the_reference_write():
    g = torch.Generator().manual_seed(0)
    k = torch.randn(10, 3, 8, generator=g)
    v = torch.randn(10, 3, 8, generator=g)
    slots = torch.randperm(6 * 4, generator=g)[:10]
    caches = [torch.zeros(6, 4, 3, 8) for _ in range(4)]
    write_kv(k, v, caches[0], caches[1], slots)
    write_kv_flat(k, v, caches[2], caches[3], slots)
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])


def test_backends_agree_end_to_end_with_chunked_prefill(tmp_path):
    """torch (the oracle), sdpa and triton (interpreter) give the same greedy tokens with a tiny budget."""
    from conftest import make_random_checkpoint

    model_dir = make_random_checkpoint(tmp_path / "m", seed=3, n_embd=32, n_head=2, n_layer=2, n_positions=64)
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    prompts = [[5, 6, 7], list(range(10, 31)), [9] * 12]
    outs = {}
    for backend in ("torch", "sdpa", "cpu", "triton"):
        eng = LLMEngine(model_dir, device="cpu", dtype="float32", block_size=8, num_blocks=16,
                        attention_backend=backend, max_num_batched_tokens=6)  # fmt: skip
        outs[backend] = {o.request_id: o.token_ids for o in eng.stream(prompts, params) if o.finished}
    assert outs["torch"] == outs["sdpa"] == outs["cpu"] == outs["triton"]


def test_chunked_prefill_example_shows_chunks_and_decodes():
    r = run_python("examples/chunked_prefill_example.py", "--budget", "24", "--long-prompt-tokens", "90")
    assert r.returncode == 0, r.stderr
    assert "chunk" in r.stdout and "all outputs equal their solo runs" in r.stdout
