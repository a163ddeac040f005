"""The n-gram proposer (prompt lookup): no model, just the request's own tokens.

Text repeats itself: code quotes its identifiers, a summary quotes its source, a play repeats its
speakers' names. If the last n tokens appeared earlier, guess that what followed them then follows
them now:

    tokens    ROMEO : I will go . \\n JULIET : Stay . \\n ROMEO : I will
                                                        └ the last n = 4 ┘
    earlier   ROMEO : I will │ go . \\n JULIET       the same 4 tokens, near the start
    proposal                   go . \\n JULIET       k = 4: what followed them there

The longest n from `prompt_lookup_max` down to `prompt_lookup_min` wins; of its matches, the most
recent (text nearby is the best guess). No match: no proposal, and the request decodes one token.
The lookup reads the runner's token row in place (a numpy view), one vectorised comparison per n.
"""

from __future__ import annotations

import numpy as np

from roseinfer.spec_decode import DraftProposal, speculating_rows


class NgramProposer:
    def __init__(self, k: int, prompt_lookup_min: int = 1, prompt_lookup_max: int = 5):
        self.k, self.min_n, self.max_n = k, prompt_lookup_min, prompt_lookup_max

    def propose(self, runner, out) -> DraftProposal:
        input_batch = runner.input_batch
        drafts = {}
        for rid, row, k in speculating_rows(runner, out, self.k):
            guess = self.lookup(input_batch.token_ids[row, : input_batch.num_tokens[row]], k)
            if guess:
                drafts[rid] = guess
        return DraftProposal(drafts)  # guessed, not sampled: no q

    def free(self, req_id: str) -> None:
        pass  # nothing is kept between steps

    def invalidate(self, req_id: str, position: int) -> None:
        pass  # no K/V of its own

    def lookup(self, tokens: np.ndarray | list[int], k: int) -> list[int]:
        """Up to k tokens that followed the latest earlier occurrence of the longest matching suffix."""
        tokens = np.asarray(tokens)
        L = len(tokens)
        for n in range(min(self.max_n, L - 1), self.min_n - 1, -1):
            windows = np.lib.stride_tricks.sliding_window_view(tokens, n)[:-1]  # [L - n, n]: all but the suffix
            hits = np.flatnonzero((windows == tokens[L - n :]).all(axis=1))  # start of each earlier match
            if len(hits):
                start = int(hits[-1]) + n  # the most recent match; propose what came after it
                return tokens[start : start + k].tolist()
        return []
