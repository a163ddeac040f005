"""Stage 08 without a GPU: every Triton kernel compiles ahead of time for real NVIDIA targets.

The rest of the suite runs the kernels in Triton's interpreter, which checks what they compute but
never compiles them. Here `tools/triton_aot.py` compiles each kernel of
roseinfer/attention/triton_kernels.py to PTX and a cubin for sm_80 (A100) and sm_90 (H100), at the
bundled model's and GPT-2 small/medium shapes, in a fresh process without TRITON_INTERPRET
(Triton's own compile cache makes later runs quick); the fp8 KV cache's variants for sm_90 only.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from conftest import REPO

pytest.importorskip("triton")


def test_every_kernel_compiles_for_sm80_and_sm90(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(REPO)
    out = tmp_path / "aot.json"
    proc = subprocess.run(
        [sys.executable, "tools/triton_aot.py", "--json", str(out)], cwd=REPO, env=env, capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads(out.read_text())
    assert report["targets"] == ["sm_80", "sm_90"]
    assert report["shapes"] == ["tiny-shakespeare", "gpt2", "gpt2-medium"]
    assert {"_write_kv_kernel", "_paged_attention_kernel"} <= set(report["launched"])
    compiled = {(r["kernel"], r["shape"], r["target"]) for r in report["results"]}
    # every kernel triton_kernels.py launches, at every shape, for both targets
    assert compiled == {(k, s, t) for k in report["launched"] for s in report["shapes"] for t in report["targets"]}
    for r in report["results"]:
        assert r["ptx_bytes"] > 0 and r["cubin_bytes"] > 0
        assert 0 < r["registers"] <= 255, r
        assert r["local_bytes"] == 0, f"{r['kernel']} spills registers at {r['shape']} on {r['target']}"
    assert "decode attention roofline" in proc.stdout
    # an fp8 KV cache: every kernel that touches the pools, compiled for sm_90 only (fp8e4nv needs sm_89+)
    assert report["fp8_targets"] == ["sm_90"]
    assert {"_write_kv_kernel", "_paged_attention_kernel", "_prefill_attention_kernel"} <= set(report["fp8_kernels"])
    fp8 = {(r["kernel"], r["shape"], r["target"]) for r in report["fp8_results"]}
    assert fp8 == {(k, s, "sm_90") for k in report["fp8_kernels"] for s in report["fp8_shapes"]}
    for r in report["fp8_results"]:
        assert r["cubin_bytes"] > 0 and r["local_bytes"] == 0, r
