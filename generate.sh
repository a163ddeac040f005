#!/usr/bin/env bash
# Continue a prompt with the bundled GPT-2, streaming tokens as they come (stages 01-02).
# First run sets up .venv.
#   ./generate.sh --prompt "Hamlet." --max-new-tokens 64 --temperature 0.8 --seed 1
#   ./generate.sh --no-kv-cache      # the naive stage-01 loop
set -euo pipefail
cd "$(dirname "$0")"
source scripts/setup.sh
exec "$VENV/bin/python" -m roseinfer.generate "$@"
