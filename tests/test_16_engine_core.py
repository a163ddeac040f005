"""Stage 16: the engine core in vLLM V1's shape.

The scheduler is driven here without any model, by hand-made runner outputs (as vLLM's
tests/v1/core/test_scheduler.py does): what it sends the runner is data only, and only what changed.
Then the runner's persistent batch, the output processor, the one config, and the layering itself.
"""

from __future__ import annotations

import ast
import dataclasses
import pickle

import numpy as np
import pytest
import torch
from conftest import REPO, core, greedy_ids

from roseinfer import LLMEngine, RequestOutputKind, SamplingParams
from roseinfer.config import EngineArgs, SchedulerConfig
from roseinfer.core.kv_cache_manager import KVCacheManager
from roseinfer.core.request import Request
from roseinfer.core.sched.output import EngineCoreOutput, ModelRunnerOutput
from roseinfer.core.sched.scheduler import Scheduler
from roseinfer.engine.output_processor import OutputProcessor
from roseinfer.sampling_params import BeamSearchParams

EOS = 99


def make_scheduler(num_blocks=32, block_size=4, max_num_seqs=8, budget=64, chunked=True, mode=None, lookahead=0,
                   prefix=False, cpu_blocks=0, max_model_len=64) -> Scheduler:  # fmt: skip
    kv = KVCacheManager(block_size, num_blocks, prefix, cpu_blocks)
    return Scheduler(SchedulerConfig(max_num_seqs, budget, chunked, mode, max_model_len, lookahead), kv)


def request(rid: str, prompt_len: int, max_tokens: int = 8, first: int = 1, **params) -> Request:
    prompt = list(range(first, first + prompt_len))
    return Request(rid, prompt, SamplingParams(temperature=0, max_tokens=max_tokens, **params), EOS, 64)


def run_step(sched: Scheduler, token: int = 7, spec: dict | None = None, accept: dict | None = None):
    """One step with a fake runner: every scheduled request that reaches the end of its sequence gets `token`
    (a verifying request gets accept[rid] of its drafts, then `token`); `spec` proposes drafts."""
    so = sched.schedule()
    out = ModelRunnerOutput()
    for rid in so.num_scheduled_tokens:
        req = sched.requests[rid]
        drafts = so.scheduled_spec_decode_tokens.get(rid, [])
        if req.num_computed_tokens == req.num_tokens + len(drafts):  # reached its end (the scheduler advanced it)
            kept = drafts[: (accept or {}).get(rid, 0)]
            out.req_ids.append(rid)
            out.sampled_token_ids.append([*kept, token])
    for f in so.forks:
        if f.sample_now:
            out.req_ids.append(f.child_id)
            out.sampled_token_ids.append([token + f.index])
    out.spec_token_ids = dict(spec or {})
    return so, sched.update_from_output(so, out)


def only_data(obj) -> bool:
    """Nothing but ids, numbers, strings, containers and params: no tensors, no live engine objects."""
    if obj is None or isinstance(obj, (str, int, float, bool, SamplingParams, BeamSearchParams)):
        return True
    if isinstance(obj, (list, tuple, set)):
        return all(only_data(x) for x in obj)
    if isinstance(obj, dict):
        return all(only_data(k) and only_data(v) for k, v in obj.items())
    if dataclasses.is_dataclass(obj):
        return all(only_data(getattr(obj, f.name)) for f in dataclasses.fields(obj))
    return False


# ---- the scheduler, with no model ------------------------------------------------------------------
def test_new_requests_arrive_whole_then_only_changes():
    sched = make_scheduler(block_size=4)
    for i, n in enumerate((5, 3)):
        sched.add_request(request(f"r{i}", n, first=10 * i + 1))
    so, outs = run_step(sched)
    assert [r.req_id for r in so.scheduled_new_reqs] == ["r0", "r1"]
    assert so.scheduled_new_reqs[0].prompt_token_ids == [1, 2, 3, 4, 5]
    assert len(so.scheduled_new_reqs[0].block_ids) == 2 and so.num_scheduled_tokens == {"r0": 5, "r1": 3}
    assert so.total_num_scheduled_tokens == 8 and only_data(so) and pickle.loads(pickle.dumps(so)) == so
    assert [(o.request_id, o.new_token_ids, o.finish_reason) for o in outs] == [("r0", [7], None), ("r1", [7], None)]
    so, _ = run_step(sched)  # r0: 6 tokens, computing its 6th (block 2 of 2); r1: 4 tokens, computing its 4th
    c = so.scheduled_cached_reqs
    assert not so.scheduled_new_reqs and c.req_ids == ["r0", "r1"] and c.num_computed_tokens == [5, 3]
    assert c.new_block_ids == [None, None] and c.new_token_ids == [(), ()]  # nothing changed but the counts
    so, _ = run_step(sched)  # r0's 7th token (still its second block), r1's 5th: into a second block
    assert so.scheduled_cached_reqs.new_block_ids[0] is None
    start, blocks = so.scheduled_cached_reqs.new_block_ids[1]
    assert start == 1 and blocks == [sched.kv_cache_manager.block_tables["r1"][1]]  # one new block id, appended


def test_the_token_budget_cuts_a_prompt_into_chunks_and_only_the_last_samples():
    sched = make_scheduler(budget=8)
    sched.add_request(request("a", 20))
    counts, sampled = [], []
    while "a" in sched.requests and len(counts) < 5:
        so, outs = run_step(sched)
        counts.append(so.num_scheduled_tokens["a"])
        sampled.append(bool(outs))
    assert counts[:3] == [8, 8, 4] and sampled[:3] == [False, False, True]
    assert counts[3] == 1  # then it decodes


def test_without_chunked_prefill_a_prompt_waits_for_a_step_with_room():
    sched = make_scheduler(budget=8, chunked=False)
    sched.add_request(request("a", 6))
    sched.add_request(request("b", 6))
    so, _ = run_step(sched)
    assert so.num_scheduled_tokens == {"a": 6}  # b (6 tokens) does not fit the 2 left: no chunk of it
    so, _ = run_step(sched)
    assert so.num_scheduled_tokens == {"a": 1, "b": 6}


def test_stops_without_text_are_the_cores_and_free_the_blocks_at_once():
    sched = make_scheduler()
    sched.add_request(request("eos", 3))
    sched.add_request(request("stop_id", 3, stop_token_ids=[42]))
    sched.add_request(request("length", 3, max_tokens=2))
    so, outs = run_step(sched, token=EOS)  # EOS ends them all (none ignores it)
    reasons = {o.request_id: o.finish_reason for o in outs}
    assert reasons == {"eos": "stop", "stop_id": "stop", "length": "stop"}
    assert sched.kv_cache_manager.num_used_blocks == 0 and not sched.requests
    so, _ = run_step(sched)
    assert so.finished_req_ids == {"eos", "stop_id", "length"}  # the runner drops their state now
    sched.add_request(request("x", 3, stop_token_ids=[42], max_tokens=3))
    _, outs = run_step(sched, token=5)
    _, outs = run_step(sched, token=42)
    assert outs[0].finish_reason == "stop"
    sched.add_request(request("y", 3, max_tokens=2))
    run_step(sched, token=5)
    _, outs = run_step(sched, token=5)
    assert outs[0].finish_reason == "length" and outs[0].new_token_ids == [5]


def test_ignore_eos_and_the_context_limit():
    sched = make_scheduler(max_model_len=64)
    sched.add_request(Request("a", list(range(1, 62)), SamplingParams(max_tokens=50, ignore_eos=True), EOS, 64))
    reasons = [run_step(sched, token=EOS)[1][0].finish_reason for _ in range(3)]
    assert reasons == [None, None, "length"]  # 61 + 3 = 64 tokens: the context is full


def test_preemption_by_recompute_resends_the_whole_table():
    sched = make_scheduler(num_blocks=5, block_size=4, mode="recompute")
    sched.add_request(request("old", 7, max_tokens=10))
    sched.add_request(request("young", 7, max_tokens=10))
    run_step(sched)  # 2 + 2 blocks of 5
    preempted = None
    for _ in range(6):
        so, _ = run_step(sched)
        if so.preempted_req_ids:
            preempted = so
            break
    assert preempted is not None and preempted.preempted_req_ids == ["young"]
    assert "young" not in so.num_scheduled_tokens and sched.waiting[0].request_id == "young"
    assert sched.requests["young"].num_computed_tokens == 0  # its tokens are kept, its K/V are not
    sched.finish_requests(["old"], "abort")
    so, _ = run_step(sched)
    c = so.scheduled_cached_reqs
    i = c.req_ids.index("young")
    assert c.resumed_from_preemption[i] and c.new_block_ids[i][0] == 0 and c.num_computed_tokens[i] == 0
    assert c.new_block_ids[i][1] == sched.kv_cache_manager.block_tables["young"]


def test_swap_out_and_back_in_moves_blocks_and_keeps_what_was_computed():
    sched = make_scheduler(num_blocks=5, block_size=4, mode="swap", cpu_blocks=8)
    sched.add_request(request("old", 7, max_tokens=10))
    sched.add_request(request("young", 7, max_tokens=10))
    run_step(sched)
    for _ in range(6):
        so, _ = run_step(sched)
        if so.blocks_to_swap_out:
            break
    assert so.preempted_req_ids == ["young"] and sched.swapped[0].request_id == "young"
    computed = sched.requests["young"].num_computed_tokens
    assert computed > 0 and len(so.blocks_to_swap_out) == len(sched.kv_cache_manager.cpu_tables["young"])
    sched.finish_requests(["old"], "abort")
    so, _ = run_step(sched)
    assert so.blocks_to_swap_in and sched.requests["young"].num_computed_tokens == computed + 1
    c = so.scheduled_cached_reqs
    assert c.resumed_from_preemption == [True] and c.new_block_ids[0][0] == 0


def test_speculation_books_the_drafts_and_gives_back_what_was_rejected():
    sched = make_scheduler(block_size=4)
    sched.add_request(request("a", 3, max_tokens=20))
    run_step(sched, spec={"a": [11, 12, 13, 14, 15]})  # prefill; the runner proposes 5 drafts
    so, outs = run_step(sched, accept={"a": 2})
    assert so.num_scheduled_tokens == {"a": 6} and so.scheduled_spec_decode_tokens == {"a": [11, 12, 13, 14, 15]}
    assert outs[0].new_token_ids == [11, 12, 7]
    req = sched.requests["a"]
    assert req.num_tokens == 7 and req.num_computed_tokens == 6  # last token + 2 accepted drafts are in the cache
    assert sched.kv_cache_manager.num_tokens["a"] == 6 and len(sched.kv_cache_manager.block_tables["a"]) == 2
    stats = sched.spec_decoding_stats
    assert (
        stats.num_drafts == 1
        and stats.num_accepted_tokens == 2
        and stats.num_accepted_tokens_per_pos == [1, 1, 0, 0, 0]
    )
    so, _ = run_step(sched)  # no new drafts: the verified ones are used up
    assert so.num_scheduled_tokens == {"a": 1} and not so.scheduled_spec_decode_tokens


def test_drafts_are_dropped_before_anyone_is_preempted():
    sched = make_scheduler(num_blocks=2, block_size=4)
    sched.add_request(request("a", 3, max_tokens=5))
    run_step(sched, spec={"a": [1, 2, 3, 4, 5, 6, 7]})  # 1 + 7 tokens would need a third block
    so, _ = run_step(sched)
    assert so.num_scheduled_tokens == {"a": 1} and not so.preempted_req_ids and not so.scheduled_spec_decode_tokens


def test_a_draft_model_books_lookahead_slots_when_there_is_room():
    sched = make_scheduler(block_size=4, lookahead=3)
    sched.add_request(request("a", 4, max_tokens=20))
    run_step(sched)
    assert len(sched.kv_cache_manager.block_tables["a"]) == 2  # 4 tokens + 3 ahead: two blocks, 4 slots in use
    assert sched.kv_cache_manager.num_tokens["a"] == 4
    tight = make_scheduler(num_blocks=1, block_size=4, lookahead=3)
    tight.add_request(request("b", 3, max_tokens=1))
    so, _ = run_step(tight)
    assert so.num_scheduled_tokens == {"b": 3}  # no room ahead: it runs anyway


def test_n_completions_fork_after_the_prompt_and_share_its_blocks():
    sched = make_scheduler(block_size=4)
    sched.add_request(request("r", 6, n=3))
    so, outs = run_step(sched)
    assert [(f.parent_id, f.child_id, f.index, f.sample_now) for f in so.forks] == [
        ("r", "r#1", 1, True),
        ("r", "r#2", 2, True),
    ]
    kv = sched.kv_cache_manager
    assert kv.block_tables["r#1"] == kv.block_tables["r"] and kv.pool.ref_count[kv.block_tables["r"][0]] == 3
    assert {o.request_id: (o.group_id, o.index, o.new_token_ids) for o in outs} == {
        "r": ("r", 0, [7]),
        "r#1": ("r", 1, [8]),
        "r#2": ("r", 2, [9]),
    }
    so, _ = run_step(sched)  # each writes into the shared, half-full second block: two copy it first
    assert len(so.blocks_to_copy) == 2 and so.num_scheduled_tokens == {"r": 1, "r#1": 1, "r#2": 1}
    sched.finish_requests(sched.sequence_ids("r"), "abort")
    assert kv.num_used_blocks == 0 and "r" not in sched.groups


def test_a_request_too_big_for_the_pool_is_refused_when_added():
    sched = make_scheduler(num_blocks=4, block_size=4)
    with pytest.raises(ValueError, match="whole KV cache pool has 4"):
        sched.add_request(request("big", 10, max_tokens=10))
    with pytest.raises(ValueError, match="max_num_seqs"):
        make_scheduler(max_num_seqs=2).add_request(request("n3", 3, n=3))
    assert not sched.requests and sched.kv_cache_manager.num_used_blocks == 0


def test_the_core_imports_no_tensor_library_and_no_tokenizer():
    """The scheduler, the KV cache manager and the request are plain Python over ids: no torch, numpy or
    tokenizer imports in roseinfer/core/."""
    banned = {"torch", "numpy", "roseinfer.tokenizer", "roseinfer.engine", "roseinfer.worker", "roseinfer.sample"}
    for path in (REPO / "roseinfer" / "core").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            for name in names:
                assert not any(name == b or name.startswith(b + ".") for b in banned), f"{path.name} imports {name}"


def test_no_import_cycles_between_the_layers():
    """Each package imports only from the layers below it (entrypoints > engine > core/worker > model): the
    house rules' layer check (tools/stages/layers.py, which tests/test_architecture.py runs with the others)."""
    from tools.stages import layers

    assert layers.check_layers() == []


# ---- through the engine: the contract on every step ------------------------------------------------
def test_every_step_message_is_data_only_and_survives_pickling(llm):
    """All features at once on a tiny pool: every SchedulerOutput is ids and numbers (it could cross to another
    process), and the outputs are the same greedy tokens as one request alone."""
    eng = LLMEngine(device="cpu", num_blocks=8, block_size=8, max_num_seqs=4, max_num_batched_tokens=24,
                    speculative_config={"method": "ngram", "num_speculative_tokens": 3})  # fmt: skip
    seen = []
    step = eng.engine_core.step

    def spy():
        so, outs = step()
        seen.append(so)
        return so, outs

    eng.engine_core.step = spy
    prompts = ["ROMEO.\nI will go.\nROMEO.\nI will", "Enter Hamlet.\n", "KING.\nO, O, O, O,"]
    for i, p in enumerate(prompts):
        eng.add_request(str(i), p, SamplingParams(temperature=0, max_tokens=24))
    eng.add_request("n2", "Romeo.\n", SamplingParams(temperature=0, max_tokens=6, n=2))
    done = {}
    while eng.has_unfinished_requests():
        done.update({o.request_id: [c.token_ids for c in o.outputs] for o in eng.step() if o.finished})
    assert all(only_data(so) for so in seen) and all(pickle.loads(pickle.dumps(so)) == so for so in seen)
    assert any(so.scheduled_spec_decode_tokens for so in seen) and any(so.forks for so in seen)
    assert any(so.preempted_req_ids for so in seen)  # the pool is small enough to preempt
    for i, p in enumerate(prompts):
        assert done[str(i)] == [greedy_ids(llm, p, 24)]
    assert done["n2"] == [greedy_ids(llm, "Romeo.\n", 6)] * 2
    assert core(eng).kv_cache_manager.num_used_blocks == 0


# ---- the persistent batch ---------------------------------------------------------------------------
def test_the_step_inputs_are_what_a_loop_over_requests_would_build(llm):
    """prepare_step's vectorised arrays equal a plain Python loop over the requests: decodes first (longest
    first), then chunks; positions, input ids and slots from each request's row and block table."""
    from roseinfer.worker.step_inputs import prepare_step

    runner = core(llm.llm_engine).model_runner
    ib = runner.input_batch
    reqs = {"d1": (list(range(1, 20)), 18, 1), "c1": (list(range(30, 60)), 10, 12), "d2": (list(range(5, 40)), 34, 1)}
    for rid, (tokens, computed, _) in reqs.items():
        blocks = list(range(100, 100 + -(-len(tokens) // 16)))[::-1]
        ib.add_request(rid, tokens, SamplingParams(), blocks, computed, None)
    try:
        ids = list(reqs)
        rows, counts = ib.rows(ids), np.array([reqs[r][2] for r in ids])
        step = prepare_step(ib, ids, rows, ib.num_computed_tokens[rows], counts, runner.backend, runner.gather_buffer,
                            runner.to_device)  # fmt: skip
        assert step.req_ids == ["d2", "d1", "c1"]  # decodes first, longest context first
        want_ids, want_pos, want_slots = [], [], []
        for rid in step.req_ids:
            tokens, computed, n = reqs[rid]
            table = ib.block_table.table[ib.req_id_to_row[rid]]
            for p in range(computed, computed + n):
                want_ids.append(tokens[p])
                want_pos.append(p)
                want_slots.append(int(table[p // 16]) * 16 + p % 16)
        meta = step.attn_metadata
        assert step.input_ids.tolist() == want_ids and step.positions.tolist() == want_pos
        assert meta.slot_mapping.tolist() == want_slots and meta.query_start_loc.tolist() == [0, 1, 2, 14]
        assert meta.seq_lens.tolist() == [35, 19, 22] and meta.num_decodes == 2 and meta.max_query_len == 12
    finally:
        for rid in reqs:
            ib.remove_request(rid)


def test_the_batch_grows_and_reuses_rows():
    from roseinfer.worker.input_batch import InputBatch

    ib = InputBatch(max_model_len=32, max_blocks_per_req=4, block_size=8, vocab_size=100, device=torch.device("cpu"),
                    capacity=2)  # fmt: skip
    for i in range(5):
        ib.add_request(str(i), [i + 1] * 3, SamplingParams(seed=i), [i], 0, torch.Generator().manual_seed(i))
    assert ib.capacity == 8 and ib.token_ids[ib.req_id_to_row["4"], :3].tolist() == [5, 5, 5]
    ib.append_tokens(ib.req_id_to_row["1"], [9, 9])
    ib.fork("1", "1#1", [7], None)
    child = ib.req_id_to_row["1#1"]
    assert ib.token_ids[child, :5].tolist() == [2, 2, 2, 9, 9] and ib.block_table.table[child, :1].tolist() == [7]
    row = ib.req_id_to_row["0"]
    ib.remove_request("0")
    assert row not in ib.generators and not ib.seeded[row]
    ib.add_request("new", [1], SamplingParams(), [3], 0, None)
    assert ib.req_id_to_row["new"] == row


# ---- the output processor ----------------------------------------------------------------------------
def test_a_stop_string_ends_the_text_and_the_tokens_where_it_completes(tokenizer):
    op = OutputProcessor(tokenizer, EOS)
    params = SamplingParams(stop=["be, or"])
    op.add_request("a", None, [1], params)
    ids = tokenizer.encode("To be, or not to be")
    outs, stopped = op.process_outputs([EngineCoreOutput("a", ids)])  # a verified run: several tokens at once
    out = outs[0]
    assert stopped == ["a"] and out.finish_reason == "stop" and out.text == "To "
    n = next(k for k in range(1, len(ids) + 1) if "be, or" in tokenizer.decode(ids[:k]))
    assert out.token_ids == ids[:n]  # the token that completed the stop string is the last one


def test_cumulative_outputs_keep_their_own_step_and_deltas_add_up(tokenizer):
    op = OutputProcessor(tokenizer, EOS)
    op.add_request("cum", None, [1], SamplingParams())
    op.add_request("delta", None, [1], SamplingParams(output_kind=RequestOutputKind.DELTA))
    ids = tokenizer.encode("Romeo, Romeo! wherefore art thou Romeo? 🌹")
    outs_c, outs_d = [], []
    for i, t in enumerate(ids):
        reason = "length" if i == len(ids) - 1 else None
        outs, _ = op.process_outputs([EngineCoreOutput("cum", [t], reason), EngineCoreOutput("delta", [t], reason)])
        outs_c.append(outs[0])
        outs_d.append(outs[1])
    text = tokenizer.decode(ids)
    assert outs_c[-1].text == text and outs_c[-1].token_ids == ids
    assert outs_c[2].token_ids == ids[:3] and outs_c[2].text == "".join(o.delta for o in outs_c[:3])  # as it was then
    assert "".join(o.outputs[0].text for o in outs_d) == text == "".join(o.delta for o in outs_c)
    assert sum((o.outputs[0].token_ids for o in outs_d), []) == ids and outs_d[-1].finished
    assert not op.requests


def test_a_final_only_request_is_decoded_once_and_equals_the_stream(tokenizer):
    op = OutputProcessor(tokenizer, EOS)
    op.add_request("final", None, [1], SamplingParams(output_kind=RequestOutputKind.FINAL_ONLY))
    assert op.requests["final"].completions[0].detokenizer is None  # no per-token work at all
    ids = tokenizer.encode("O, what a rogue 🌹 and peasant") + [EOS]
    outs = []
    for i, t in enumerate(ids):
        o, _ = op.process_outputs([EngineCoreOutput("final", [t], "stop" if i == len(ids) - 1 else None)])
        outs += o
    assert len(outs) == 1 and outs[0].text == tokenizer.decode(ids[:-1]) and outs[0].token_ids == ids


# ---- the one config ----------------------------------------------------------------------------------
def test_one_config_checks_everything_before_loading_and_fills_the_defaults():
    cfg = EngineArgs(device="cpu").create_engine_config()
    assert cfg.scheduler_config.max_num_batched_tokens == 2048 and cfg.cache_config.num_gpu_blocks > 0
    no_chunks = EngineArgs(device="cpu", enable_chunked_prefill=False).create_engine_config()
    assert no_chunks.scheduler_config.max_num_batched_tokens == max(2048, cfg.model_config.max_model_len)
    spec = EngineArgs(device="cpu", speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    assert spec.create_engine_config().scheduler_config.num_lookahead_tokens == 0  # n-gram writes no K/V
    with pytest.raises(TypeError, match="unexpected keyword argument 'max_num_seq'"):
        LLMEngine(device="cpu", max_num_seq=4)


def test_the_command_line_flags_are_the_config_fields():
    import argparse

    parser = argparse.ArgumentParser()
    EngineArgs.add_cli_args(parser)
    args = parser.parse_args(["--max-num-seqs", "8", "--no-enable-prefix-caching", "--enforce-eager",
                              "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 2}'])  # fmt: skip
    engine_args = EngineArgs.from_cli_args(args)
    assert engine_args == EngineArgs(max_num_seqs=8, enable_prefix_caching=False, enforce_eager=True,
                                     speculative_config={"method": "ngram", "num_speculative_tokens": 2})  # fmt: skip
    assert parser.parse_args([]).__dict__ == dataclasses.asdict(EngineArgs())


def test_the_package_layout_shows_the_layers():
    pkg = REPO / "roseinfer"
    for folder in ("entrypoints", "engine", "core", "core/sched", "worker", "sample", "spec_decode", "model_executor",
                   "attention", "tokenizer"):  # fmt: skip
        assert (pkg / folder / "__init__.py").exists(), folder
    flat = [p.name for p in pkg.glob("*.py")]
    assert sorted(flat) == ["__init__.py", "__main__.py", "checks.py", "config.py", "custom_ops.py", "outputs.py",
                            "sampling_params.py"]  # fmt: skip
    too_long = [str(p.relative_to(pkg)) for p in pkg.rglob("*.py") if len(p.read_text().splitlines()) > 420]
    assert not too_long, too_long


def test_a_step_never_copies_a_whole_request(monkeypatch, llm):
    """No per-step work that grows with a request's length: decoding one more token of a long request reads at
    most one block of its token list (to hash a block that just filled) and never its text."""
    eng = llm.llm_engine
    eng.add_request("long", list(range(1, 400)), SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    eng.step()  # the prefill
    req = core(eng).scheduler.requests["long"]

    class Watched(list):
        longest = 0

        def __getitem__(self, i):
            if isinstance(i, slice):
                Watched.longest = max(Watched.longest, len(range(*i.indices(len(self)))))
            return super().__getitem__(i)

        def __iter__(self):
            Watched.longest = len(self)
            return super().__iter__()

    req.all_token_ids = Watched(req.all_token_ids)
    for _ in range(3):
        eng.step()
    assert Watched.longest <= eng.config.cache_config.block_size
    while eng.has_unfinished_requests():
        eng.step()


# ---- async scheduling: step t + 1 is scheduled while step t runs -------------------------------------
def test_async_scheduling_counts_the_token_in_flight():
    """Without a model: step 2 is scheduled before step 1's output is in. The request that samples in step 1
    has a placeholder, so step 2 computes its next position; a request whose in-flight token is its last is
    not scheduled again; the output of step 1 then fills the placeholder in."""
    kv = KVCacheManager(4, 16)
    sched = Scheduler(SchedulerConfig(8, 64, True, None, 64, async_scheduling=True), kv)
    sched.add_request(request("a", 5, max_tokens=3))
    sched.add_request(request("b", 5, max_tokens=1))
    so1 = sched.schedule()
    assert [sched.requests[r].num_output_placeholders for r in "ab"] == [1, 1]
    so2 = sched.schedule()  # before step 1's output: a's 6th position (its token in flight); b is done already
    assert so2.num_scheduled_tokens == {"a": 1} and so2.scheduled_cached_reqs.num_computed_tokens == [5]
    outs = sched.update_from_output(so1, ModelRunnerOutput(["a", "b"], [[7], [8]]))
    assert [(o.request_id, o.finish_reason) for o in outs] == [("a", None), ("b", "length")]
    assert sched.requests["a"].num_output_placeholders == 1 and sched.requests["a"].num_tokens == 6
    so3 = sched.schedule()  # a's second token is in flight, its third (and last) is computed now
    assert so3.num_scheduled_tokens == {"a": 1} and so3.finished_req_ids == {"b"}
    sched.update_from_output(so2, ModelRunnerOutput(["a"], [[9]]))
    assert sched.schedule().num_scheduled_tokens == {}  # its last token is in flight: nothing more to run
    outs = sched.update_from_output(so3, ModelRunnerOutput(["a"], [[5]]))
    assert outs[0].finish_reason == "length" and sched.requests == {}


def test_async_scheduling_gives_the_same_tokens(llm):
    """Async scheduling only moves host work next to the forward: the same greedy and seeded tokens, stop strings
    found a step late but cut in the same place, n > 1 and beams, preemption on a tiny pool, and no leaks."""
    from roseinfer import LLM

    prompts = ["Romeo.\n", "ROMEO.\nI will go.\nJULIET.\nStay.\nROMEO.\nI will", "Enter Hamlet.\n", "KING."]
    cases = [SamplingParams(temperature=0, max_tokens=30), SamplingParams(temperature=0, max_tokens=30, stop=["\n\n"]),
             SamplingParams(temperature=0.8, seed=3, max_tokens=20),
             SamplingParams(temperature=0, n=2, max_tokens=8)]  # fmt: skip
    for kwargs in ({}, {"num_blocks": 14, "block_size": 8, "max_num_seqs": 3, "preemption_mode": "swap"}):
        fast = LLM(device="cpu", async_scheduling=True, **kwargs)
        for params in cases:
            want = [[c.token_ids for c in o.outputs] for o in llm.generate(prompts, params, use_tqdm=False)]
            got = [[c.token_ids for c in o.outputs] for o in fast.generate(prompts, params, use_tqdm=False)]
            assert got == want, (kwargs, params)
            assert core(fast.llm_engine).kv_cache_manager.num_used_blocks == 0
        beams = BeamSearchParams(beam_width=3, max_tokens=6)
        want = [[s.token_ids for s in b.sequences] for b in llm.beam_search(prompts[:2], beams)]
        assert [[s.token_ids for s in b.sequences] for b in fast.beam_search(prompts[:2], beams)] == want
    assert core(fast.llm_engine).scheduler.num_preemptions > 0


def test_async_scheduling_never_mixes_up_a_reused_request_id(llm):
    """A request that finished while the next step was already in flight, and a new request with its id: the
    late token of the old one must not land in the new one."""
    eng = LLMEngine(device="cpu", async_scheduling=True)
    params = SamplingParams(temperature=0, max_tokens=3)
    for prompt in ("Romeo.\n", "KING.", "Enter Hamlet.\n"):
        eng.add_request("same", prompt, params)
        while eng.has_unfinished_requests():
            outs = eng.step()
        assert outs[-1].token_ids == greedy_ids(llm, prompt, 3)


def test_async_scheduling_refuses_speculation():
    with pytest.raises(ValueError, match="async_scheduling does not work with speculative_config"):
        spec = {"method": "ngram", "num_speculative_tokens": 2}
        EngineArgs(device="cpu", async_scheduling=True, speculative_config=spec).create_engine_config()


# ---- CUDA only: graphs of decode steps (skipped without a GPU) -------------------------------------
@pytest.mark.cuda
def test_cuda_graph_decode_steps_give_the_eager_tokens():
    from conftest import PROMPTS

    from roseinfer import LLM

    params = SamplingParams(temperature=0, max_tokens=24)
    eager = LLM(device="cuda", dtype="float32", attention_backend="triton", enforce_eager=True)
    graphs = LLM(device="cuda", dtype="float32", attention_backend="triton", max_num_seqs=8)
    assert core(eager.llm_engine).model_runner.cuda_graphs is None
    runner = core(graphs.llm_engine).model_runner
    assert runner.cuda_graphs is not None and runner.cuda_graphs.batch_sizes == [1, 2, 4, 8]
    want = [o.token_ids for o in eager.generate(PROMPTS, params, use_tqdm=False)]
    assert [o.token_ids for o in graphs.generate(PROMPTS, params, use_tqdm=False)] == want
    assert [o.token_ids for o in graphs.generate(PROMPTS[:3], params, use_tqdm=False)] == want[:3]  # padded to 4


@pytest.mark.cuda
def test_a_replayed_graph_computes_the_eager_hidden_states():
    from roseinfer import LLM

    llm = LLM(device="cuda", dtype="float32", attention_backend="triton", max_num_seqs=16)
    runner = core(llm.llm_engine).model_runner
    seen = {}
    run = runner.cuda_graphs.run

    def check(step):
        hidden = run(step).clone()
        eager = runner.model.forward_paged(step.input_ids, step.positions, runner.kv_cache.layers, step.attn_metadata)
        seen[len(step.rows)] = (hidden - eager).abs().max().item()
        return hidden

    runner.cuda_graphs.run = check
    llm.generate(["Romeo.\n"] * 5, SamplingParams(temperature=0, max_tokens=6), use_tqdm=False)
    assert seen and all(err < 1e-4 for err in seen.values()), seen
