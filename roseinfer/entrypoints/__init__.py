"""Entry points: the ways in. `LLM` (offline), `AsyncLLMEngine` and the OpenAI-compatible server, the CLI."""
