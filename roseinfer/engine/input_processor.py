"""The input processor: a prompt (text or token ids) in, checked token ids out, before anything is queued.

Bad input is a clear error here, in the caller's thread, and the core only ever sees valid ids:

    ""                     ValueError: empty
    [1, "2"] / None / 3.5  TypeError: a prompt is a str or a list of int token ids
    [5, 99999]             ValueError: outside the vocabulary
    600 tokens, context 512    ValueError: no room for a new token

and the parameters that only the engine can judge, because they name token ids of its vocabulary
(`check_params`): logit_bias keys, stop_token_ids. The step can then never fail on one request's values.
"""

from __future__ import annotations

from roseinfer.checks import is_int
from roseinfer.sampling_params import BeamSearchParams, SamplingParams
from roseinfer.structured_output.backend_xgrammar import validate_structured_outputs
from roseinfer.tokenizer import Tokenizer


class InputProcessor:
    def __init__(self, tokenizer: Tokenizer, vocab_size: int, max_model_len: int):
        self.tokenizer, self.vocab_size, self.max_model_len = tokenizer, vocab_size, max_model_len

    def process(self, prompt: str | list[int]) -> tuple[str | None, list[int]]:
        """(the prompt's text, or None for token ids; its token ids)."""
        if isinstance(prompt, str):
            if prompt == "":
                raise ValueError("prompt is empty: give at least one character")
            ids = self.tokenizer.encode(prompt)
        elif isinstance(prompt, (list, tuple)) and all(is_int(t) for t in prompt):
            ids = list(prompt)
            if not ids:
                raise ValueError("prompt is empty: give at least one token id")
            bad = [t for t in ids if not 0 <= t < self.vocab_size]
            if bad:
                raise ValueError(f"prompt token ids {bad[:5]} are outside the vocabulary [0, {self.vocab_size})")
        else:
            raise TypeError(f"prompt must be a str or a list of int token ids, got {type(prompt).__name__}")
        if len(ids) >= self.max_model_len:
            raise ValueError(
                f"prompt is {len(ids)} tokens long but the model's context is {self.max_model_len} "
                f"tokens; it must be shorter to leave room for at least one new token"
            )
        return (prompt if isinstance(prompt, str) else None), ids

    def check_params(self, params: SamplingParams | BeamSearchParams) -> None:
        """ValueError if the parameters name a token id outside the vocabulary, or carry a constraint that does not
        compile (an invalid JSON schema, regex or grammar: xgrammar says why; checked once per distinct one)."""
        V = self.vocab_size
        for name, ids in (("logit_bias", params.logit_bias or ()), ("stop_token_ids", params.stop_token_ids)):
            bad = sorted(t for t in ids if not 0 <= t < V)
            if bad:
                raise ValueError(f"{name} has token ids {bad[:5]} outside the vocabulary [0, {V})")
        if params.structured_outputs is not None:
            validate_structured_outputs(params.structured_outputs)
