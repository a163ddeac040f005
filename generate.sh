#!/usr/bin/env bash
# Continue a prompt with the bundled GPT-2, streaming tokens as they come (python -m roseinfer.entrypoints.generate).
# First run sets up .venv. The naive no-cache loop of chapter 01 (--no-kv-cache) is at its tag, stage-01-naive-decode.
#   ./generate.sh --prompt "Hamlet." --max-new-tokens 64 --temperature 0.8 --seed 1
set -euo pipefail
cd "$(dirname "$0")"
source scripts/setup.sh
exec "$VENV/bin/python" -m roseinfer.entrypoints.generate "$@"
