#!/usr/bin/env bash
# On a GPU machine: the @pytest.mark.cuda tests, ./verify_paged_attention.sh, the gpu benchmark
# (random-weight gpt2-medium shapes, fp16) and the engine step with CUDA graphs off and on and with
# async scheduling (stage 16). Writes results/gpu_report.md.
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
run "pytest -m cuda" "$PY" -m pytest -q -m cuda tests/
run "verify_paged_attention" "$PY" examples/verify_paged_attention.py
run "benchmark --workload gpu (gpt2-medium shapes, fp16)" "$PY" scripts/benchmark.py --workload gpu \
  --model gpt2-medium --dtype float16 --batch-size 256 --json results/gpu_benchmark.json
for opts in "--enforce-eager" "" "--async-scheduling"; do  # stage 16: CUDA graphs off / on, and async scheduling
  run "engine step at 256 requests ${opts:-(CUDA graphs)}" "$PY" benchmarks/engine/bench_engine_step.py --device cuda $opts \
    --out "results/gpu_engine_step${opts// /}.json"
done
echo "wrote $report"
exit $status
