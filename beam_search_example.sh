#!/usr/bin/env bash
# Stage 11: a beam search step by step (block tables, shared blocks, copy-on-write), then n = 8 vs 8 requests.
#   ./beam_search_example.sh --beam-width 8 --max-tokens 24
set -euo pipefail
cd "$(dirname "$0")"
source scripts/setup.sh
exec "$VENV/bin/python" examples/beam_search_example.py "$@"
