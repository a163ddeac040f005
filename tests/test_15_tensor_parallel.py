"""Stage 15: tensor parallelism on torch.distributed (gloo on this CPU): TP = 2 gives TP = 1's and Hugging
Face's greedy tokens through LLM, LLMEngine and the server; each rank's KV pool is half; bad sizes are clear
errors; and no process outlives its engine, whichever side dies first."""

from __future__ import annotations

import gc
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import openai
import pytest
import torch
import torch.distributed as dist
from conftest import PROMPTS, REPO, core, hf_greedy, make_random_checkpoint
from test_13_server import running_server

from roseinfer import LLM, BeamSearchParams, SamplingParams
from roseinfer.entrypoints.cli import serve_parser
from roseinfer.worker.tp_worker import TensorParallelRunner

GREEDY = SamplingParams(temperature=0, max_tokens=16)
# a pool of 16 blocks of 4 tokens for 8 requests: they preempt each other; a budget of 24 tokens a step cuts the
# longer prompts into chunks; prefix caching is on by default, and the last two prompts repeat the first two
TIGHT = dict(device="cpu", dtype="float32", block_size=4, num_blocks=16, max_num_seqs=8, max_num_batched_tokens=24)
WORKLOAD = PROMPTS + PROMPTS[:2]


def alive(pids: list[int]) -> list[int]:
    """The pids that still run (a zombie waiting to be reaped has exited)."""
    out = []
    for pid in pids:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (FileNotFoundError, ProcessLookupError):
            continue
        if state not in ("Z", "X"):
            out.append(pid)
    return out


def wait_gone(pids: list[int], timeout: float = 30) -> list[int]:
    deadline = time.time() + timeout
    while alive(pids) and time.time() < deadline:
        time.sleep(0.1)
    return alive(pids)


@pytest.fixture(scope="module")
def tp1():
    """TP = 1 on the same tight pool: the greedy token ids and the KV pool's bytes."""
    llm = LLM(**TIGHT)
    outs = llm.generate(WORKLOAD, GREEDY, use_tqdm=False)
    return [o.token_ids for o in outs], core(llm.llm_engine).model_runner.kv_cache.nbytes


def test_tp2_equals_tp1_and_hf_through_llm_and_llm_engine_with_half_the_kv_per_rank(tp1, hf_model):
    ref_ids, tp1_kv_bytes = tp1
    threads = torch.get_num_threads()
    with LLM(tensor_parallel_size=2, **TIGHT) as llm:
        runner = core(llm.llm_engine).model_runner  # rank 0's TensorParallelRunner
        pids = runner.pids
        assert isinstance(runner, TensorParallelRunner) and len(pids) == 1 and alive(pids) == pids
        # each rank holds 2 of the 4 heads: half of TP = 1's pool, on rank 0 and on the worker
        assert runner.kv_cache.nbytes * 2 == tp1_kv_bytes and runner.worker_kv_bytes == [tp1_kv_bytes // 2]
        assert runner.kv_cache.layers[0][0].shape[2] == 2

        llm.llm_engine.trace = []
        outs = llm.generate(WORKLOAD, GREEDY, use_tqdm=False)
        assert [o.token_ids for o in outs] == ref_ids
        for o in outs[:3]:
            assert o.token_ids == hf_greedy(hf_model, o.prompt_token_ids, 16)
        stats, trace = llm.llm_engine.get_stats(), llm.llm_engine.trace
        assert stats["num_preemptions"] > 0 and stats["prefix_cache_hits"] > 0
        long_prompt = max(range(len(WORKLOAD)), key=lambda i: len(outs[i].prompt_token_ids))
        first = next(e for e in trace if str(long_prompt) in e["num_scheduled_tokens"])
        assert first["num_scheduled_tokens"][str(long_prompt)] < len(outs[long_prompt].prompt_token_ids)  # chunked

        engine = llm.llm_engine  # the online API, requests added while others run
        for i, prompt in enumerate(WORKLOAD):
            engine.add_request(f"r{i}", prompt, GREEDY)
            engine.step()
        done = {}
        while engine.has_unfinished_requests():
            done |= {o.request_id: o.token_ids for o in engine.step() if o.finished}
        assert [done[f"r{i}"] for i in range(len(WORKLOAD))] == ref_ids
        assert core(llm.llm_engine).kv_cache_manager.stats().used_blocks == 0
    assert wait_gone(pids, timeout=10) == [] and not dist.is_initialized()
    assert torch.get_num_threads() == threads  # rank 0's threads are given back


def test_tp2_with_speculative_decoding_gives_the_tp1_tokens(tp1):
    """Stage 14 on top: the target verifies drafts across both ranks; the draft model runs whole, on rank 0."""
    ref_ids, _ = tp1
    draft = str(REPO / "roseinfer" / "models" / "tiny-shakespeare-draft")
    spec = {"method": "draft_model", "model": draft, "num_speculative_tokens": 3}
    with LLM(tensor_parallel_size=2, speculative_config=spec, **TIGHT) as llm:
        assert [o.token_ids for o in llm.generate(WORKLOAD, GREEDY, use_tqdm=False)] == ref_ids
        stats = llm.llm_engine.get_stats()
        assert stats["spec_decode_num_accepted_tokens"] > 0 and stats["num_preemptions"] > 0


def test_tp2_with_async_scheduling_gives_the_tp1_tokens(tp1):
    """Stage 16: async scheduling launches a step before the last one's tokens are known; the workers get them
    with the next step's message all the same."""
    ref_ids, _ = tp1
    with LLM(tensor_parallel_size=2, async_scheduling=True, **TIGHT) as llm:
        assert [o.token_ids for o in llm.generate(WORKLOAD, GREEDY, use_tqdm=False)] == ref_ids
        assert core(llm.llm_engine).kv_cache_manager.num_used_blocks == 0


def test_tp2_warms_up_every_rank_together_and_gives_the_tp1_tokens(tp1):
    """A warm-up runs a forward on every rank (its all-reduces need them all), before the first request."""
    ref_ids, _ = tp1
    with LLM(tensor_parallel_size=2, warmup=True, **TIGHT) as llm:
        assert [o.token_ids for o in llm.generate(WORKLOAD, GREEDY, use_tqdm=False)] == ref_ids


def test_tp2_server_streams_the_tp1_text(tp1):
    ref_ids, _ = tp1
    with running_server(tensor_parallel_size=2, **{k: v for k, v in TIGHT.items() if k not in ("device", "dtype")}) as (
        url,
        engine,
    ):
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
        tok = engine.engine.tokenizer
        for i in (0, 1, 4):
            out = client.completions.create(model="roseinfer", prompt=WORKLOAD[i], max_tokens=16, temperature=0)
            assert out.choices[0].text == tok.decode(ref_ids[i]).replace("<|endoftext|>", "")
        stream = client.completions.create(model="roseinfer", prompt=WORKLOAD[4], max_tokens=16, temperature=0,
                                           stream=True)  # fmt: skip
        assert "".join(c.choices[0].text for c in stream) == tok.decode(ref_ids[4]).replace("<|endoftext|>", "")
        pids = core(engine.engine).model_runner.pids
    engine.engine.close()  # what `roseinfer serve` does when uvicorn returns
    assert wait_gone(pids, timeout=10) == [] and not dist.is_initialized()


def test_swap_and_copy_on_write_move_blocks_on_every_rank_and_gc_stops_the_workers():
    kw = dict(device="cpu", dtype="float32", block_size=4, num_blocks=12, preemption_mode="swap", swap_space=0.01)
    params = [GREEDY, SamplingParams(n=2, temperature=0.8, seed=3, max_tokens=10)] * 2
    prompts = ["Romeo.\n", "KING.", "To be, or not to be", "O, what a rogue and peasant slave am I!"]
    beam = BeamSearchParams(beam_width=3, max_tokens=8)

    def run(llm):
        outs = llm.generate(prompts, params, use_tqdm=False)
        beams = llm.beam_search(["Romeo.\n"], beam)[0].sequences
        return [[c.token_ids for c in o.outputs] for o in outs], [b.token_ids for b in beams]

    expected = run(LLM(**kw))
    llm = LLM(tensor_parallel_size=2, **kw)
    pids = core(llm.llm_engine).model_runner.pids
    assert run(llm) == expected
    assert llm.llm_engine.get_stats()["num_swapped_out"] > 0
    del llm
    gc.collect()
    assert wait_gone(pids, timeout=10) == [] and not dist.is_initialized()


def test_a_worker_killed_mid_run_is_a_clear_error_and_every_process_stops():
    llm = LLM(device="cpu", dtype="float32", tensor_parallel_size=2)
    engine, pid = llm.llm_engine, core(llm.llm_engine).model_runner.pids[0]
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(str(i), prompt, SamplingParams(max_tokens=400, ignore_eos=True))
    engine.step()
    threading.Timer(0.2, os.kill, (pid, signal.SIGKILL)).start()  # while steps run
    t0 = time.time()
    with pytest.raises(RuntimeError, match=rf"worker rank 1 \(pid {pid}\) exited with code -9"):
        while engine.has_unfinished_requests():
            engine.step()
    assert time.time() - t0 < 30
    assert not engine.output_processor.requests and not core(engine).scheduler.requests  # every request aborted
    assert core(engine).kv_cache_manager.stats().used_blocks == 0
    with pytest.raises(RuntimeError, match="cannot run any more steps"):
        llm.generate("Romeo.\n", use_tqdm=False)
    assert alive([pid]) == [] and not dist.is_initialized()
    llm.close()  # a no-op now


RANK0 = """
import sys
from roseinfer import LLM, BeamSearchParams, SamplingParams
llm = LLM(device="cpu", dtype="float32", tensor_parallel_size=2)
print(*llm.llm_engine.engine_core.engine_core.model_runner.pids, flush=True)
while True:
    llm.generate(["Romeo.\\n"] * 4, SamplingParams(max_tokens=64, ignore_eos=True), use_tqdm=False)
"""


@pytest.mark.parametrize("how", ["SIGKILL", "Ctrl-C"])
def test_workers_exit_when_rank0_dies_or_is_interrupted(how):
    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1"}
    rank0 = subprocess.Popen([sys.executable, "-c", RANK0], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             cwd=REPO, env=env, start_new_session=True)  # fmt: skip
    try:
        pids = [int(p) for p in rank0.stdout.readline().split()]
        assert len(pids) == 1 and alive(pids) == pids, rank0.stderr.read() if rank0.poll() is not None else ""
        time.sleep(0.5)  # mid-generate
        if how == "SIGKILL":
            rank0.kill()  # no atexit, no finalizer: the worker must notice on its own
        else:
            os.killpg(rank0.pid, signal.SIGINT)  # what a terminal's Ctrl-C sends: the whole process group
        rank0.wait(timeout=30)
        assert wait_gone(pids, timeout=30) == []
    finally:
        if rank0.poll() is None:
            rank0.kill()
            rank0.wait()


def test_bad_tensor_parallel_sizes_are_clear_errors(tmp_path):
    for bad, err, msg in ((0, ValueError, "an int >= 1"), ("2", TypeError, "an int >= 1"),
                          (True, TypeError, "an int >= 1"),
                          (len(os.sched_getaffinity(0)) + 1, ValueError, "one CPU core per rank")):  # fmt: skip
        with pytest.raises(err, match=msg):
            LLM(device="cpu", tensor_parallel_size=bad)
    three_heads = make_random_checkpoint(tmp_path / "h3", n_head=3, n_embd=48)
    with pytest.raises(ValueError, match=r"tensor_parallel_size=2 must divide the model's num_attention_heads=3"):
        LLM(three_heads, device="cpu", tensor_parallel_size=2)
    assert not dist.is_initialized()


def test_serve_takes_tensor_parallel_size():
    import argparse

    sub = argparse.ArgumentParser().add_subparsers(dest="command")
    serve_parser(sub)
    args = sub.choices["serve"].parse_args(["--tensor-parallel-size", "2"])
    assert args.tensor_parallel_size == 2
