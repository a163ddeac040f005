"""The model: GPT-2 written out, its layers, and the loader that reads Hugging Face checkpoints."""
