#!/usr/bin/env bash
# The test command: set up .venv if needed, lint, then run the whole pytest suite
# (notebooks included). Extra arguments go to pytest, e.g. ./scripts/test.sh -k tokenizer
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/setup.sh
"$VENV/bin/ruff" check .
"$VENV/bin/ruff" format --check .
"$VENV/bin/python" -m pytest "$@"
