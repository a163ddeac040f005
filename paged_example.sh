#!/usr/bin/env bash
# Stage 07: a small paged KV pool forces preemption; prints block tables and preemption events.
#   ./paged_example.sh --num-blocks 24 --block-size 8
set -euo pipefail
cd "$(dirname "$0")"
source scripts/setup.sh
exec "$VENV/bin/python" examples/paged_example.py "$@"
