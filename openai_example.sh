#!/usr/bin/env bash
# Stage 19: what a vLLM user reaches for, against roseinfer's server: chat, logprobs with echo, penalties,
# /tokenize, OpenAI-shaped errors, an API key, vLLM's metric names. See chapters/19-openai-serving/README.md.
set -euo pipefail
cd "$(dirname "$0")"
source scripts/setup.sh
exec "$VENV/bin/python" examples/openai_example.py "$@"
