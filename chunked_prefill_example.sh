#!/usr/bin/env bash
# Stage 09: a long prompt is prefilled in chunks while short requests keep decoding; one row per step.
#   ./chunked_prefill_example.sh --budget 64 --long-prompt-tokens 300
set -euo pipefail
cd "$(dirname "$0")"
source scripts/setup.sh
exec "$VENV/bin/python" examples/chunked_prefill_example.py "$@"
