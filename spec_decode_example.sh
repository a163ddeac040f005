#!/usr/bin/env bash
# Stage 14: speculative decoding, step by step: drafts proposed, verified in one forward, accepted or not.
#   ./spec_decode_example.sh --method ngram -k 4        ./spec_decode_example.sh --method draft_model -k 8
set -euo pipefail
cd "$(dirname "$0")"
source scripts/setup.sh
exec "$VENV/bin/python" examples/spec_decode_example.py "$@"
