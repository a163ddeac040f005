"""Text <-> token ids: tiktoken's byte-level BPE for GPT-2's formats, the `tokenizers` library for any other
tokenizer.json (Llama, Qwen, Mistral); `Tokenizer.from_model_dir` picks one."""

from roseinfer.tokenizer.fast_tokenizer import FastTokenizer
from roseinfer.tokenizer.tokenizer import Tokenizer

AnyTokenizer = Tokenizer | FastTokenizer  # vLLM's name for "whichever tokenizer the model has"

__all__ = ["AnyTokenizer", "FastTokenizer", "Tokenizer"]
