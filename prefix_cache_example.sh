#!/usr/bin/env bash
# Stage 10: requests sharing a system prompt, with and without prefix caching: cached tokens and TTFT.
#   ./prefix_cache_example.sh --num-requests 8 --block-size 8
set -euo pipefail
cd "$(dirname "$0")"
source scripts/setup.sh
exec "$VENV/bin/python" examples/prefix_cache_example.py "$@"
