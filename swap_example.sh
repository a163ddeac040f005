#!/usr/bin/env bash
# Stage 12: the same requests on a tiny KV pool, preempted by swap and by recompute, side by side.
#   ./swap_example.sh --requests 12 --num-blocks 16 --figure queues.png
set -euo pipefail
cd "$(dirname "$0")"
source scripts/setup.sh
exec "$VENV/bin/python" examples/swap_example.py "$@"
