#!/usr/bin/env bash
# Stage 03: several prompts through LLM.generate, printed under "### request N".
#   ./offline_example.sh --prompts "Romeo." "Juliet." --temperature 0 --max-tokens 32
set -euo pipefail
cd "$(dirname "$0")"
source scripts/setup.sh
exec "$VENV/bin/python" examples/offline_example.py "$@"
