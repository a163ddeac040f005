#!/usr/bin/env bash
# Stage 21: structured outputs and tool calls through the OpenAI API: a JSON schema, a regex, a choice, a JSON
# object and forced tool calls from the bundled tiny Llama, checked and printed. See examples/structured_output_example.py.
set -euo pipefail
cd "$(dirname "$0")"
source scripts/setup.sh
exec "$VENV/bin/python" examples/structured_output_example.py "$@"
