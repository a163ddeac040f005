"""Check the paged-attention kernels (chapter 08).

On CUDA:  1. Triton kernels vs the PyTorch reference over a sweep of shapes;
          2. end-to-end greedy: triton backend == torch backend == HF `generate` on the bundled model;
          3. a micro-benchmark: µs per decode-attention call and achieved GB/s vs the card's bandwidth.
On CPU:   the kernels run in Triton's interpreter on small shapes (1 and 2, no timing).

    ./verify_paged_attention.sh
"""

from __future__ import annotations

import os
import sys
import time

import torch

ON_GPU = torch.cuda.is_available()
if not ON_GPU:
    os.environ["TRITON_INTERPRET"] = "1"  # before the kernels are defined

from roseinfer.attention.reference import paged_attention_reference, write_kv_reference  # noqa: E402
from roseinfer.attention.triton_kernels import paged_attention_auto, paged_attention_triton, write_kv_triton  # noqa: E402

DEV = torch.device("cuda" if ON_GPU else "cpu")
TOL = {torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 3e-2}


def random_pool(lens: list[int], H: int, D: int, block_size: int, dtype: torch.dtype, seed: int = 0):
    """A pool holding random K/V for sequences of the given lengths, in shuffled physical blocks."""
    g = torch.Generator().manual_seed(seed)
    n_blocks = [-(-n // block_size) for n in lens]
    num_blocks = sum(n_blocks) + 1
    perm = torch.randperm(num_blocks, generator=g).tolist()
    tables, slots, start = [], [], 0
    for n, nb in zip(lens, n_blocks, strict=True):
        table = perm[start : start + nb]
        start += nb
        tables.append(table + [0] * (max(n_blocks) - nb))
        slots += [table[p // block_size] * block_size + p % block_size for p in range(n)]
    shape = (num_blocks, block_size, H, D)
    k_cache, v_cache = torch.zeros(shape, dtype=dtype, device=DEV), torch.zeros(shape, dtype=dtype, device=DEV)
    key = torch.randn(sum(lens), H, D, generator=g).to(dtype).to(DEV)
    value = torch.randn(sum(lens), H, D, generator=g).to(dtype).to(DEV)
    write_kv_triton(key, value, k_cache, v_cache, torch.tensor(slots, device=DEV))
    ref_k, ref_v = torch.zeros_like(k_cache), torch.zeros_like(v_cache)
    write_kv_reference(key, value, ref_k, ref_v, torch.tensor(slots, device=DEV))
    assert torch.equal(k_cache, ref_k) and torch.equal(v_cache, ref_v), "write kernel != reference"
    bt = torch.tensor(tables, dtype=torch.int32, device=DEV)
    return k_cache, v_cache, bt, torch.tensor(lens, dtype=torch.int32, device=DEV)


def sweep() -> bool:
    cases = []
    for block_size in (8, 16, 32):
        for D in (64, 128) if ON_GPU else (16, 32):
            for dtype in (torch.float32, torch.float16, torch.bfloat16):
                lens = [1, 37, 300, 1500, 2048] if ON_GPU else [1, 7, 2 * block_size + 3]
                cases.append((block_size, D, dtype, lens))
    ok = True
    print(f"1. kernel vs reference ({len(cases)} shapes, H={8 if ON_GPU else 2})")
    for block_size, D, dtype, lens in cases:
        H = 8 if ON_GPU else 2
        k, v, bt, ctx = random_pool(lens, H, D, block_size, dtype)
        q = torch.randn(len(lens), H, D, device=DEV).to(dtype)
        ref = paged_attention_reference(q, k, v, bt, ctx, D**-0.5).float()
        err = max((fn(q, k, v, bt, ctx, D**-0.5).float() - ref).abs().max().item()
                  for fn in (paged_attention_triton, paged_attention_auto))  # fmt: skip
        good = err <= TOL[dtype]
        ok &= good
        print(f"   block {block_size:2d} D {D:3d} {str(dtype).removeprefix('torch.'):8s} max |err| {err:.2e} "
              f"{'ok' if good else 'FAIL'}")  # fmt: skip
    return ok


def end_to_end() -> bool:
    from roseinfer import DEFAULT_MODEL, LLMEngine, SamplingParams

    prompts = ["Romeo.\n", "Enter Hamlet, reading.\n", "KING LEAR.\nBlow, winds, and crack your cheeks!"]
    if ON_GPU:
        model, n = DEFAULT_MODEL, 64
    else:  # the interpreter is slow: a tiny random GPT-2 with head_dim 16
        import tempfile
        from pathlib import Path

        from tools.models.checkpoints import make_random_checkpoint

        model = make_random_checkpoint(Path(tempfile.mkdtemp()) / "m", n_embd=32, n_head=2, n_layer=2)
        prompts, n = [[5, 6, 7], [9, 10, 11, 12, 13]], 6
    params = SamplingParams(temperature=0, max_tokens=n)
    outs = {}
    for backend in ("triton", "torch"):
        eng = LLMEngine(model, device=DEV, dtype="float32", block_size=16, num_blocks=64, attention_backend=backend)
        outs[backend] = {o.request_id: o.token_ids for o in eng.stream(prompts, params) if o.finished}
    ok = outs["triton"] == outs["torch"]
    print(f"2. end-to-end greedy ({len(prompts)} prompts, {n} tokens): triton == torch: {ok}")
    if ON_GPU:
        from transformers import GPT2LMHeadModel

        hf = GPT2LMHeadModel.from_pretrained(model, dtype=torch.float32).to(DEV).eval()
        tok = eng.tokenizer
        for i, p in enumerate(prompts):
            ids = torch.tensor([tok.encode(p)], device=DEV)
            ref = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                              pad_token_id=tok.eos_token_id)[0, ids.shape[1]:].tolist()  # fmt: skip
            same = ref == outs["triton"][str(i)]
            ok &= same
            print(f"   prompt {i}: triton == HF generate: {same}")
    return ok


def micro_benchmark() -> None:
    from benchmarks.gpu_utils import cuda_time, peak_bandwidth

    bw, source = peak_bandwidth(DEV)
    print(f"3. decode attention micro-benchmark on {torch.cuda.get_device_name(DEV)}; "
          f"bandwidth {bw / 1e12:.2f} TB/s ({source})")  # fmt: skip
    print(f"   {'B':>4} {'context':>7} {'H':>3} {'D':>4} {'kernel':>8} {'µs/call':>9} {'GB/s':>8} {'% of peak':>9}")
    H, D, block_size, dtype = 16, 64, 16, torch.float16  # gpt2-medium's attention shape
    for B, ctx in [(1, 8192), (8, 4096), (64, 1024), (256, 1024), (256, 2048)]:
        k, v, bt, lens = random_pool([ctx] * B, H, D, block_size, dtype)
        q = torch.randn(B, H, D, device=DEV, dtype=dtype)
        kv_bytes = 2 * B * ctx * H * D * dtype.itemsize + 2 * q.numel() * dtype.itemsize + bt.numel() * 4
        args = (q, k, v, bt, lens, D**-0.5)
        for name, fn in (("v1", paged_attention_triton), ("auto", paged_attention_auto)):
            sec = cuda_time(lambda fn=fn, args=args: fn(*args))
            print(f"   {B:>4} {ctx:>7} {H:>3} {D:>4} {name:>8} {sec * 1e6:>9.1f} {kv_bytes / sec / 1e9:>8.0f} "
                  f"{kv_bytes / sec / bw:>8.0%}")  # fmt: skip
        ref_sec = cuda_time(lambda args=args: paged_attention_reference(*args), iters=10)
        print(f"   {B:>4} {ctx:>7} {H:>3} {D:>4} {'torch':>8} {ref_sec * 1e6:>9.1f}   (reference, for scale)")


def main() -> int:
    t0 = time.time()
    where = torch.cuda.get_device_name(DEV) if ON_GPU else "CPU, Triton interpreter (no GPU: correctness only)"
    print(f"paged attention check on {where}; torch {torch.__version__}")
    ok = sweep()
    ok &= end_to_end()
    if ON_GPU:
        micro_benchmark()
    else:
        print("3. micro-benchmark skipped: it needs a CUDA GPU")
    print(f"{'ALL OK' if ok else 'FAILED'} in {time.time() - t0:.1f}s")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
