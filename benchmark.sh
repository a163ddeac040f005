#!/usr/bin/env bash
# Stage 05 on: roseinfer vs HF generate (static batches) vs HF continuous batching, same run.
#   ./benchmark.sh                              # --workload small on the bundled model
#   ./benchmark.sh --workload tiny --json /tmp/bench.json
set -euo pipefail
cd "$(dirname "$0")"
source scripts/setup.sh
exec "$VENV/bin/python" scripts/benchmark.py "$@"
