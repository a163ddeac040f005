"""The n-gram proposer (prompt lookup): no model, just the request's own tokens.

Text repeats itself: code quotes its identifiers, a summary quotes its source, a play repeats its
speakers' names. If the last n tokens appeared earlier, guess that what followed them then follows
them now:

    tokens    ROMEO : I will go . \n JULIET : Stay . \n ROMEO : I will
                                                        └ the last n = 4 ┘
    earlier   ROMEO : I will │ go . \n JULIET       the same 4 tokens, near the start
    proposal                   go . \n JULIET       k = 4: what followed them there

The longest n from `prompt_lookup_max` down to `prompt_lookup_min` wins; of its matches, the most
recent (text nearby is the best guess). No match: no proposal, and the request decodes one token.
"""

from __future__ import annotations

import torch

from roseinfer.session import InferenceSession
from roseinfer.spec_decode import max_spec_tokens


class NgramProposer:
    def __init__(self, k: int, prompt_lookup_min: int = 1, prompt_lookup_max: int = 5):
        self.k, self.min_n, self.max_n = k, prompt_lookup_min, prompt_lookup_max

    def propose(self, seqs: list[InferenceSession]) -> None:
        for seq in seqs:
            k = max_spec_tokens(seq, self.k)
            seq.spec_token_ids = self.lookup(seq.token_ids(0, seq.num_tokens), k) if k else []
            seq.spec_draft_probs = None  # a lookup is certain of its guess: q is one-hot

    def free(self, request_id: str) -> None:
        pass  # nothing is kept between steps

    def lookup(self, token_ids: list[int], k: int) -> list[int]:
        """Up to k tokens that followed the latest earlier occurrence of the longest matching suffix."""
        tokens = torch.tensor(token_ids)  # [L]
        L = len(token_ids)
        for n in range(min(self.max_n, L - 1), self.min_n - 1, -1):
            windows = tokens.unfold(0, n, 1)[:-1]  # [L - n, n]: every n-gram but the suffix itself
            hits = (windows == tokens[L - n :]).all(dim=1).nonzero()  # [M, 1] start of each earlier match
            if len(hits):
                start = int(hits[-1]) + n  # the most recent match; propose what came after it
                return token_ids[start : start + k]
        return []
