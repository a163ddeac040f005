"""Text <-> token ids: tiktoken's byte-level BPE, read from a model directory in any of GPT-2's formats."""

from roseinfer.tokenizer.tokenizer import Tokenizer

__all__ = ["Tokenizer"]
