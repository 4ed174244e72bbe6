"""n-gram drafting (prompt lookup): output that copies its context is proposed from it.

Code edits, quoting, extraction and summaries with verbatim spans repeat long runs of
their prompt; when the last few tokens occurred before, the tokens that followed them
then are a good guess for what follows now. The lookup costs tens of microseconds per
request on a few thousand tokens (numpy window compares), nothing next to a forward pass.
"""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


class NgramProposer:
    def __init__(self, ngram_min: int, ngram_max: int, num_speculative_tokens: int) -> None:
        self.ngram_min = ngram_min
        self.ngram_max = ngram_max
        self.num_speculative_tokens = num_speculative_tokens

    def propose(self, token_ids: list[int], max_num_drafts: int | None = None) -> list[int]:
        """Drafts to follow ``token_ids`` (prompt and output so far): the tokens after the latest
        earlier occurrence of the longest suffix n-gram (``ngram_max`` down to ``ngram_min``
        tokens) that has a full run of drafts after it; empty when no suffix occurred before.
        At most ``max_num_drafts`` (default ``num_speculative_tokens``) tokens."""
        k = self.num_speculative_tokens if max_num_drafts is None else min(max_num_drafts, self.num_speculative_tokens)
        num_tokens = len(token_ids)
        if k <= 0 or num_tokens <= self.ngram_min:
            return []
        tokens = np.asarray(token_ids, dtype=np.int64)
        # Candidate starts: where the last token occurred before (cheap first filter).
        ends = np.flatnonzero(tokens[:-1] == tokens[-1])  # [num_hits]: positions i with tokens[i] == last
        for n in range(min(self.ngram_max, num_tokens - 1), self.ngram_min - 1, -1):
            starts = ends[ends >= n - 1] - (n - 1)  # occurrences of the n-gram would start here
            if starts.size == 0:
                continue
            if n > 1:
                windows = sliding_window_view(tokens[:-1], n)[starts]  # [num_hits, n]
                starts = starts[(windows == tokens[num_tokens - n :]).all(axis=1)]
                if starts.size == 0:
                    continue
            # The latest occurrence (recent context predicts best) that still has k tokens after
            # it, else the latest: in a repeating run the latest one ends at the present.
            full = starts[starts + n + k <= num_tokens]
            follow = int(full[-1] if full.size else starts[-1]) + n
            return tokens[follow : follow + k].tolist()
        return []
