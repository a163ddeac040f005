#!/usr/bin/env bash
# Stage 22: the bundled tiny Llama quantized to int8 (W8A8 and W8A16, compressed-tensors) and run with an fp8 KV
# cache, each compared with fp32; the blocks an fp8 cache holds. See examples/quantization_example.py.
set -euo pipefail
cd "$(dirname "$0")"
source scripts/setup.sh
exec "$VENV/bin/python" examples/quantization_example.py "$@"
