"""Linear layers at this CPU's limit: weights reordered once, at load time, for oneDNN.

On a CPU, `F.linear(x, W, b)` goes to MKL's sgemm, which reads W in its plain [out, in] layout and
repacks panels of it into the order its AVX-512 kernel wants, on every call. Decoding calls every
linear layer once per step with only a few dozen rows of x, so that repacking is paid again and again
for little arithmetic. oneDNN can do the reorder once, ahead of time:

    load time:  W [out, in]  ── torch.ops.mkldnn._reorder_linear_weight ──►  W' (oneDNN's blocked layout)
    each step:  x [N, in]    ── torch.ops.mkldnn._linear_pointwise(x, W', b) ──►  [N, out]

W' is an opaque `torch._mkldnn` tensor that only oneDNN's linear can read; the plain W stays in the
model (tensor-parallel sharding, state dicts and the `aten` path read it), so the weights of every
linear layer are held twice. `_linear_pointwise` can also apply an activation on the way out (a
"post-op"): GPT-2's MLP runs c_fc and its tanh-GELU in one call.

Chapter 17 measures the choice on this CPU at the step's shapes (scripts/roofline.py): the packed
path reaches the GEMM peak already at 32 rows, where sgemm is well short of it, and the LM head
([N, 768] × [768, 50257], the step's biggest GEMM) gets the most out of it.

oneDNN builds (and keeps) a primitive, with its JIT-compiled kernel and buffers, for every shape it is called
with: about 0.65 MiB each on this CPU. A server's steps have any number of rows from 1 to the token budget, so
it would build one for each, and its memory would grow for as long as new row counts come (a soak of
`roseinfer serve` grew 21 MiB a minute). So the rows are padded to a few sizes (`bucket_rows`): up to 16 rows
(small decode steps) the exact count, above that four sizes per doubling, each a multiple of a quarter of the
power of two below it:

    1 2 ... 16 | 20 24 28 32 | 40 48 56 64 | 80 96 112 128 | 160 192 224 256 | ... | 1280 1536 1792 2048

44 shapes per layer for a budget of 2048 tokens; the padding is under a quarter of the rows, and zeros whose
outputs are dropped. Even so a server meets a new size now and then for as long as it runs (the rarest are the
largest), so `roseinfer serve` builds them all at start-up (`record_calls` and `warm_up`, called by
roseinfer/worker/warm_up.py): from then on its memory stays flat.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
import torch.nn as nn
import torch.nn.functional as F

from roseinfer.model_executor.dense_linear import DenseWeight, dense_linear, dense_supported, pack_dense_weight

LINEAR_BACKENDS = ("auto", "dense", "onednn", "aten")


def onednn_supported(device: torch.device, dtype: torch.dtype) -> bool:
    """oneDNN's packed linear runs on a CPU, in fp32 or bf16, when torch was built with it."""
    return device.type == "cpu" and dtype in (torch.float32, torch.bfloat16) and torch.backends.mkldnn.is_available()


def resolve_linear_backend(name: str, device: torch.device, dtype: torch.dtype) -> str:
    """'auto' -> 'dense' where it runs (the project's GEMM, dense_linear.py: a CPU with AVX-512, fp32 or bf16), else
    'onednn' where that runs (a CPU, fp32 or bf16), else 'aten' (F.linear: cuBLAS, or MKL on a CPU)."""
    if not isinstance(name, str):
        raise TypeError(f"linear_backend must be one of {LINEAR_BACKENDS}, got {name!r}")
    if name not in LINEAR_BACKENDS:
        raise ValueError(f"unknown linear_backend {name!r}; use one of {LINEAR_BACKENDS}")
    ok = onednn_supported(device, dtype)
    if name == "onednn" and not ok:
        raise ValueError(f"linear_backend='onednn' runs on a CPU in float32 or bfloat16, not on {device} in {dtype}; "
                         "use 'auto' or 'aten'")  # fmt: skip
    dense = name in ("dense", "auto") and dense_supported(device, dtype)  # (builds the C++ ops on a CPU, once)
    if name == "dense" and not dense:
        raise ValueError(f"linear_backend='dense' runs on a CPU with AVX-512 (AVX512-BF16 for bfloat16) in float32 or "
                         f"bfloat16 with the C++ ops built, not on {device} in {dtype} here; use 'auto'")  # fmt: skip
    if name == "auto":
        return "dense" if dense else "onednn" if ok else "aten"
    return name


def pack_weight(weight: torch.Tensor, backend: str = "onednn") -> torch.Tensor | DenseWeight:
    """[out, in] -> the same matrix reordered once: into oneDNN's blocked layout (an opaque tensor), or with
    backend 'dense' into the panels of dense_linear.py."""
    if backend == "dense":
        return pack_dense_weight(weight)
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach())


EXACT_ROWS = 16  # up to this many rows oneDNN sees the exact count; above, four sizes per doubling


def bucket_rows(num_rows: int) -> int:
    """The row count oneDNN is called with for `num_rows` rows: 1, ..., 16, then 20, 24, 28, 32, 40, 48, ...:
    above 16, a multiple of a quarter of the power of two below `num_rows` (n in (2^k, 2^(k+1)] -> steps of 2^k/4)."""
    if num_rows <= EXACT_ROWS:
        return num_rows
    step = 1 << ((num_rows - 1).bit_length() - 3)  # 2^k / 4
    return -(-num_rows // step) * step


def row_buckets(max_rows: int) -> list[int]:
    """Every size `bucket_rows` gives for 1 .. max_rows rows, smallest first."""
    return sorted({bucket_rows(n) for n in range(1, max_rows + 1)})


@contextmanager
def record_calls():
    """Note every call of oneDNN's linear made inside, one of each kind: yields a dict from (in features, out
    features, dtype, has a bias, post-op), what a primitive depends on besides the rows, to the arguments of its
    first call. oneDNN's entry point is swapped for one that notes its arguments, and put back on the way out."""
    calls, linear = {}, torch.ops.mkldnn._linear_pointwise

    def noting(x, packed, bias, *post_op):
        out = linear(x, packed, bias, *post_op)
        key = (x.shape[1], out.shape[1], x.dtype, bias is not None, post_op[0], tuple(post_op[1]), post_op[2])
        calls.setdefault(key, (packed, bias, *post_op))
        return out

    torch.ops.mkldnn._linear_pointwise = noting
    try:
        yield calls
    finally:
        torch.ops.mkldnn._linear_pointwise = linear


def warm_up(calls: dict, max_rows: int) -> int:
    """Make each recorded kind of call once at every row bucket of up to `max_rows` rows (zeros), so that oneDNN
    builds all its primitives now rather than while serving. Returns the number of calls."""
    n = 0
    for (in_features, _, dtype, *_), args in calls.items():
        for rows in row_buckets(max_rows):
            torch.ops.mkldnn._linear_pointwise(torch.zeros(rows, in_features, dtype=dtype), *args)
            n += 1
    return n


def packed_linear(x: torch.Tensor, packed: torch.Tensor | DenseWeight, bias: torch.Tensor | None,
                  gelu_tanh: bool = False):  # fmt: skip
    """x [..., in] -> x Wᵀ + b [..., out] through the packed W; `gelu_tanh` also applies GELU (tanh form).
    For oneDNN the N rows of x are padded to `bucket_rows(N)` for the call, so that it sees only a few shapes."""
    if isinstance(packed, DenseWeight):  # any row count; the GELU after the GEMM, on its rounded output
        out = dense_linear(x, packed, bias)
        return F.gelu(out, approximate="tanh") if gelu_tanh else out
    lead, rows = x.shape[:-1], x.reshape(-1, x.shape[-1])  # [N, in]
    num_rows = rows.shape[0]
    padded = bucket_rows(num_rows)
    if padded != num_rows:
        rows = torch.cat([rows, rows.new_zeros(padded - num_rows, rows.shape[1])])  # [padded, in]
    if gelu_tanh:
        out = torch.ops.mkldnn._linear_pointwise(rows, packed, bias, "gelu", [], "tanh")
    else:
        out = torch.ops.mkldnn._linear_pointwise(rows, packed, bias, "none", [], "")
    return out[:num_rows].reshape(*lead, out.shape[-1])  # [..., out]


def pack_linear_layers(model: nn.Module, backend: str = "onednn") -> int:
    """Give every `nn.Linear` in `model` a `packed` copy of its weight for `backend` (layers read it in forward);
    returns how many were packed."""
    n = 0
    for m in model.modules():
        if isinstance(m, nn.Linear):
            m.packed = pack_weight(m.weight, backend)
            n += 1
    return n
