#!/usr/bin/env bash
# Stage 04: run a few prompts and print the KV block tables after selected steps.
#   ./kv_blocks_example.sh --block-size 16 --num-blocks 16
set -euo pipefail
cd "$(dirname "$0")"
source scripts/setup.sh
exec "$VENV/bin/python" examples/kv_blocks_example.py "$@"
