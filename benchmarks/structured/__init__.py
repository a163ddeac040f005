"""Chapter 21's measurements: structured outputs against vLLM's CPU build (agreement of ids, and the cost)."""
