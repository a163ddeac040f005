#!/usr/bin/env bash
# Stage 20: the extension's threads, a Llama layer's small ops fused against their PyTorch references, decode
# attention a K/V head's group at a time (GB/s of K/V), and greedy tokens with and without the fused ops. See
# chapters/20-fused-cpu-kernels/README.md.   ./fused_kernels_example.sh --threads 1   for one thread.
set -euo pipefail
cd "$(dirname "$0")"
source scripts/setup.sh
exec "$VENV/bin/python" examples/fused_kernels_example.py "$@"
