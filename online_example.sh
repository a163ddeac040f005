#!/usr/bin/env bash
# Stage 06: requests arrive over time and join the running batch (continuous batching).
#   ./online_example.sh --num-requests 10 --max-num-seqs 3 --seed 2
set -euo pipefail
cd "$(dirname "$0")"
source scripts/setup.sh
exec "$VENV/bin/python" examples/online_example.py "$@"
