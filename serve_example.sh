#!/usr/bin/env bash
# Stage 13: start the OpenAI-compatible server, talk to it with the openai client, read /metrics, stop it.
#   ./serve_example.sh --max-tokens 32        (./serve.sh keeps a server running)
set -euo pipefail
cd "$(dirname "$0")"
source scripts/setup.sh
exec "$VENV/bin/python" examples/serve_example.py "$@"
