#!/usr/bin/env bash
# Stage 17: this CPU's roofline, every GEMM of a GPT-2-small step on it through F.linear and through
# oneDNN with packed weights, then the same requests through both. See chapters/17-cpu-roofline/README.md.
set -euo pipefail
cd "$(dirname "$0")"
source scripts/setup.sh
"$VENV/bin/python" benchmarks/engine/roofline.py --threads 1 "$@"
exec "$VENV/bin/python" examples/cpu_gemm_example.py --threads 1
