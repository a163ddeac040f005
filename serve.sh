#!/usr/bin/env bash
# Stage 13: the OpenAI-compatible server on 127.0.0.1:8000 (Ctrl-C stops it).
#   ./serve.sh --port 8001 --max-num-seqs 32
set -euo pipefail
cd "$(dirname "$0")"
source scripts/setup.sh
exec "$VENV/bin/python" -m roseinfer serve "$@"
