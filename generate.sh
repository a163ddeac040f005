#!/usr/bin/env bash
# Stage 01: continue a prompt with the bundled GPT-2. First run sets up .venv.
#   ./generate.sh --prompt "Hamlet." --max-new-tokens 64 --temperature 0.8 --seed 1
set -euo pipefail
cd "$(dirname "$0")"
source scripts/setup.sh
exec "$VENV/bin/python" -m roseinfer.generate "$@"
