#!/usr/bin/env bash
# On a GPU machine: the @pytest.mark.cuda tests, the fused ops' Triton kernels (their cuda tests and a timing
# against the PyTorch references), stage 22's Triton kernels (their cuda tests: the W8A8 int8 GEMM, the fp8 KV
# cache), ./verify_paged_attention.sh, the gpu benchmark (random-weight gpt2-medium shapes, fp16) and the engine
# step with CUDA graphs off and on and with async scheduling (stage 16). The cuda tests include stage 21's grammar
# bitmask on CUDA (xgrammar's kernel; skipped where xgrammar is not installed).
# Writes results/gpu_report.md.
#
# It uses an existing CUDA build of torch (PYTHON, default python3) rather than .venv, whose
# torch is the CPU wheel. That interpreter needs torch, triton, transformers, tiktoken,
# safetensors, tqdm and pytest.
set -uo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" TRITON_INTERPRET=0
"$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" || {
  echo "no CUDA GPU visible to $PY: nothing to check here (the CPU suite covers the kernels in the interpreter)"
  exit 1
}
mkdir -p results
report=results/gpu_report.md
status=0
run() {  # run a titled command, append its output to the report as a code block
  echo "## $1" >>"$report"; echo '```' >>"$report"
  shift
  "$@" 2>&1 | tee -a "$report"; local rc=${PIPESTATUS[0]}
  echo '```' >>"$report"; echo >>"$report"
  [ "$rc" = 0 ] || status=1
}
{
  echo "# roseinfer GPU check, $(date -u '+%Y-%m-%d %H:%M UTC')"
  echo
  "$PY" -c "import torch, triton, transformers; print(f'{torch.cuda.get_device_name()} | torch {torch.__version__} | triton {triton.__version__} | transformers {transformers.__version__}')"
  echo
} >"$report"
# One launch of each fused op at a Llama-3-8B layer's shapes for 256 tokens (fp16), the kernel against the
# PyTorch reference it replaces; CUDA events, median of 50 after 10 warm-up runs (the kernels run in place
# on the same tensors again and again: only the time matters here).
FUSED_OPS_TIMING='
import torch
from roseinfer.model_executor import triton_ops as T
from roseinfer.model_executor.activations import SiluAndMul
from roseinfer.model_executor.layernorm import RMSNorm
from roseinfer.model_executor.rotary_embedding import ApplyRotary, RotaryEmbedding
def ms(fn):
    for _ in range(10): fn()
    times = []
    for _ in range(50):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record(); fn(); b.record(); torch.cuda.synchronize(); times.append(a.elapsed_time(b))
    return sorted(times)[25]
N, C, H, Hkv, D, I, dt = 256, 4096, 32, 8, 128, 14336, torch.float16
norm, rot = RMSNorm(C, 1e-5).cuda().half(), ApplyRotary()
x, res = torch.randn(N, C, device="cuda", dtype=dt), torch.randn(N, C, device="cuda", dtype=dt)
q, k, _ = torch.randn(N, (H + 2 * Hkv) * D, device="cuda", dtype=dt).split([H * D, Hkv * D, Hkv * D], -1)
q, k = q.view(N, H, D), k.view(N, Hkv, D)
cos, sin = RotaryEmbedding(D, 500000.0).cuda()(torch.arange(N, device="cuda"), dt)
gu = torch.randn(N, 2 * I, device="cuda", dtype=dt)
cases = [("rms_norm + residual [256, 4096]", lambda: norm.forward_native(x, res), lambda: T.rms_norm(x, norm.weight, 1e-5, res)),
         ("rotary q [256, 32, 128], k [256, 8, 128]", lambda: rot.forward_native(q, k, cos, sin), lambda: T.rotary(q, k, cos, sin)),
         ("silu_and_mul [256, 28672]", lambda: SiluAndMul().forward_native(gu), lambda: T.silu_and_mul(gu))]
print(f"{torch.cuda.get_device_name()}, fp16, ms per call (median of 50)")
print("{:<42} {:>8} {:>8} {:>8}".format("op", "native", "triton", "speed-up"))
for name, native, fused in cases:
    n, f = ms(native), ms(fused)
    print(f"{name:<42} {n:>8.4f} {f:>8.4f} {n / f:>7.1f}x")
'
run "pytest -m cuda" "$PY" -m pytest -q -m cuda tests/ --ignore=tests/test_20_triton_fused_ops.py \
  --ignore=tests/test_22_triton_int8.py --ignore=tests/test_22_triton_fp8_kv.py
run "fused ops in Triton: pytest -m cuda tests/test_20_triton_fused_ops.py" "$PY" -m pytest -q -m cuda \
  tests/test_20_triton_fused_ops.py
run "fused ops in Triton vs PyTorch: one call each, Llama-3-8B shapes, 256 tokens" "$PY" -c "$FUSED_OPS_TIMING"
run "W8A8 int8 GEMM and fp8 KV cache in Triton: pytest -m cuda tests/test_22_triton_*.py" "$PY" -m pytest -q -m cuda \
  tests/test_22_triton_int8.py tests/test_22_triton_fp8_kv.py
run "verify_paged_attention" "$PY" examples/verify_paged_attention.py
run "benchmark --workload gpu (gpt2-medium shapes, fp16)" "$PY" scripts/benchmark.py --workload gpu \
  --model gpt2-medium --dtype float16 --batch-size 256 --json results/gpu_benchmark.json
for opts in "--enforce-eager" "" "--async-scheduling"; do  # stage 16: CUDA graphs off / on, and async scheduling
  run "engine step at 256 requests ${opts:-(CUDA graphs)}" "$PY" benchmarks/engine/bench_engine_step.py --device cuda $opts \
    --out "results/gpu_engine_step${opts// /}.json"
done
echo "wrote $report"
exit $status
