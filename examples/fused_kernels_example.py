"""Stage 20: the small ops of a Llama layer fused, decode attention a K/V head's group at a time, both cores busy.

    python examples/fused_kernels_example.py              # SmolLM2-135M's layer shapes, 2 threads
    python examples/fused_kernels_example.py --threads 1

1. The extension's threads: how many of torch's threads an `at::parallel_for` in it runs on.
2. Each fused op against its PyTorch reference (the CustomOp's forward_native) on one layer's tensors of a
   32-sequence decode step: the largest difference, and the time of each (median of 50 calls).
3. Decode attention for 32 sequences of 512 tokens: the C++ kernel against the reference, its time per layer
   call, and the K/V bytes it reads per second.
4. A random-weight Llama of SmolLM2's layer shapes (2 layers): greedy tokens with the fused ops, with the
   references, and from transformers.
"""

from __future__ import annotations

import argparse
import base64
import statistics
import tempfile
import time
from pathlib import Path

import torch

from roseinfer import LLM, SamplingParams, custom_ops
from roseinfer.attention.reference import paged_attention_reference
from roseinfer.model_executor.activations import SiluAndMul
from roseinfer.model_executor.layernorm import RMSNorm
from roseinfer.model_executor.rotary_embedding import ApplyRotary, RotaryEmbedding

C, H, HKV, D, INTER = 576, 9, 3, 64, 1536  # SmolLM2-135M: hidden, query heads, K/V heads, head_dim, MLP width
ROWS = 32  # one decode step of 32 sequences


def median_ms(fn, calls: int = 50) -> float:
    fn()  # warm-up (and the first call picks the implementation)
    times = []
    for _ in range(calls):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


def compare(name: str, fused, native, make_args) -> None:
    """Run `fused` (forward: the C++ kernel) and `native` (forward_native) on fresh copies of the same inputs."""
    out_f, out_n = fused(*make_args()), native(*make_args())
    out_f, out_n = (out_f, out_n) if isinstance(out_f, tuple) else ((out_f,), (out_n,))
    diff = max(float((a - b).abs().max()) for a, b in zip(out_f, out_n, strict=True))
    args_f, args_n = make_args(), make_args()
    t_f, t_n = median_ms(lambda: fused(*args_f)), median_ms(lambda: native(*args_n))
    print(f"{name:<30} max |fused - reference| {diff:.1e}   reference {t_n * 1e3:7.1f} us   fused {t_f * 1e3:7.1f} us"
          f"   {t_n / t_f:4.1f}x")  # fmt: skip


def small_ops() -> None:
    g = torch.Generator().manual_seed(0)
    x, res = torch.randn(ROWS, C, generator=g), torch.randn(ROWS, C, generator=g)
    norm = RMSNorm(C, 1e-5)
    norm.weight.data = torch.rand(C, generator=g) + 0.5
    compare("add + RMSNorm [32, 576]", norm, norm.forward_native, lambda: (x.clone(), res.clone()))
    qkv = torch.randn(ROWS, (H + 2 * HKV) * D, generator=g)
    cos, sin = RotaryEmbedding(D, 10000.0)(torch.arange(100, 100 + ROWS), torch.float32)

    def rope_args():
        q, k, _ = qkv.clone().split([H * D, HKV * D, HKV * D], dim=-1)  # views of one [N, (H + 2Hkv) * D] row
        return q.view(ROWS, H, D), k.view(ROWS, HKV, D), cos, sin

    rotary = ApplyRotary(is_neox=True)
    compare("RoPE on q and k [32, 9|3, 64]", rotary, rotary.forward_native, rope_args)
    act, gate_up = SiluAndMul(), torch.randn(ROWS, 2 * INTER, generator=g)
    compare("SiLU(gate) * up [32, 3072]", act, act.forward_native, lambda: (gate_up,))


def decode_attention(context: int = 512, block_size: int = 16) -> None:
    g = torch.Generator().manual_seed(1)
    blocks_per_seq = context // block_size
    num_blocks = ROWS * blocks_per_seq
    k_cache = torch.randn(num_blocks, block_size, HKV, D, generator=g)
    v_cache = torch.randn(num_blocks, block_size, HKV, D, generator=g)
    tables = torch.randperm(num_blocks, generator=g).view(ROWS, blocks_per_seq).int()  # scattered blocks
    lens = torch.full((ROWS,), context, dtype=torch.int32)
    q = torch.randn(ROWS, H, D, generator=g)
    scale = D**-0.5
    kernel = lambda: torch.ops.roseinfer.paged_decode(q, k_cache, v_cache, tables, lens, scale)  # noqa: E731
    diff = float((kernel() - paged_attention_reference(q, k_cache, v_cache, tables, lens, scale)).abs().max())
    ms = median_ms(kernel)
    bytes_read = 2 * ROWS * context * HKV * D * 4  # every K and V vector once, fp32
    print(f"decode attention, {ROWS} x {context} tokens: max |kernel - reference| {diff:.1e}, {ms:.3f} ms per layer "
          f"call, {bytes_read / ms / 1e6:.1f} GB/s of K/V")  # fmt: skip


def greedy(threads: int) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()

    cfg = LlamaConfig(vocab_size=512, hidden_size=C, intermediate_size=INTER, num_hidden_layers=2,
                      num_attention_heads=H, num_key_value_heads=HKV, max_position_embeddings=512,
                      tie_word_embeddings=True)  # fmt: skip
    torch.manual_seed(0)
    hf = LlamaForCausalLM(cfg).eval()
    prompt = [5, 17, 99, 3, 250]
    with torch.no_grad():
        want = hf.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False)[0, len(prompt) :].tolist()
    with tempfile.TemporaryDirectory() as tmp:
        hf.save_pretrained(tmp)
        # a placeholder tokenizer (random weights make no text anyway): 256 bytes, then distinct strings
        toks = [bytes([b]) for b in range(256)] + [b"<%d>" % i for i in range(256, cfg.vocab_size - 1)]
        ranks = "".join(f"{base64.b64encode(t).decode()} {rank}\n" for rank, t in enumerate(toks))
        (Path(tmp) / "tokenizer.tiktoken").write_text(ranks)
        params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
        got = {}
        for impl in ("auto", "native"):
            llm = LLM(tmp, device="cpu", dtype="float32", custom_ops=impl, kv_cache_memory=2**26)
            got[impl] = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
    print(
        f"greedy, 24 tokens: fused == reference: {got['auto'] == got['native']}, "
        f"fused == transformers: {list(got['auto']) == want}"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if not custom_ops.available():
        raise SystemExit("the C++ extension could not be built here (a C++ compiler and ninja are needed)")
    print(
        f"== 1. threads: torch has {torch.get_num_threads()}, an at::parallel_for in the extension runs on "
        f"{int(torch.ops.roseinfer.parallel_threads(64))}"
    )
    print("\n== 2. a Llama layer's small ops, fused vs their references (one decode step of 32 sequences)")
    small_ops()
    print("\n== 3. decode attention through the block tables")
    decode_attention()
    print("\n== 4. a random-weight Llama of SmolLM2's layer shapes, 2 layers")
    greedy(args.threads)


if __name__ == "__main__":
    with torch.no_grad():
        main()
