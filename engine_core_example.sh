#!/usr/bin/env bash
# Stage 16: what the scheduler tells the model runner at each step (only what changed), and the time of
# each layer of one step. See chapters/16-engine-core/README.md.
set -euo pipefail
cd "$(dirname "$0")"
source scripts/setup.sh
exec "$VENV/bin/python" examples/engine_core_example.py "$@"
