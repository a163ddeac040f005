#!/usr/bin/env bash
# Stage 18: the bundled tiny Llama (grouped-query attention: 8 query heads, 2 K/V heads) through the engine: its
# shape, KV bytes per token against GPT-2, greedy text equal to transformers', a chat turn. See
# chapters/18-llama-family/README.md.   ./llama_example.sh --model DIR   runs any Llama/Mistral/Qwen2/Qwen3 directory.
set -euo pipefail
cd "$(dirname "$0")"
source scripts/setup.sh
exec "$VENV/bin/python" examples/llama_example.py "$@"
