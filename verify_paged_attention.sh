#!/usr/bin/env bash
# Stage 08: check the Triton paged-attention kernels. On CUDA: kernel vs reference sweep,
# end-to-end greedy equality (triton == torch == HF) and a micro-benchmark. On CPU: the
# same checks on small shapes in Triton's interpreter.
# On a GPU machine with CUDA torch already installed, PYTHON=python3 ./verify_paged_attention.sh
# uses that interpreter instead of .venv (whose torch is the CPU wheel).
set -euo pipefail
cd "$(dirname "$0")"
if [ -n "${PYTHON:-}" ]; then
  export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
  exec "$PYTHON" examples/verify_paged_attention.py "$@"
fi
source scripts/setup.sh
exec "$VENV/bin/python" examples/verify_paged_attention.py "$@"
