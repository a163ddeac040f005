#!/usr/bin/env bash
# Stage 15: the model split across 2 processes (torch.distributed, gloo on CPU): same tokens as 1 process,
# half the KV pool per rank, the all-reduces of a step, clean shutdown, and a killed worker.
#   ./tensor_parallel_example.sh --max-tokens 32
set -euo pipefail
cd "$(dirname "$0")"
source scripts/setup.sh
exec "$VENV/bin/python" examples/tensor_parallel_example.py "$@"
