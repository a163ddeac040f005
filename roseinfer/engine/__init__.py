"""The engine: prompts in, text out. Input and output processing around the engine core (scheduler + runner)."""
