"""One request's place in its grammar: a matcher advanced over every token the request outputs.

The state is a function of the output tokens alone, so it survives anything that
keeps them: a preemption (the KV is recomputed, the tokens stay), a hand-off from a
prefill instance (the decode side starts a fresh matcher and advances it over the
first token, which P sampled under the same grammar), a retry on another decode
instance (the same again). :meth:`GrammarState.sync` advances over whatever output
tokens it has not seen, so whoever builds a state passes the tokens so far and is done.
"""

from __future__ import annotations

import logging

from llguidance import LLMatcher

logger = logging.getLogger(__name__)


class GrammarState:
    __slots__ = ("matcher", "num_consumed", "request_id")

    def __init__(self, matcher: LLMatcher, request_id: str) -> None:
        self.matcher = matcher
        self.request_id = request_id
        self.num_consumed = 0  # output tokens the matcher has advanced over

    def sync(self, output_token_ids: list[int]) -> None:
        """Advance over the output tokens not consumed yet (all of them for a new state)."""
        for token_id in output_token_ids[self.num_consumed :]:
            self.accept(token_id)

    def accept(self, token_id: int) -> None:
        """Advance over one sampled token. A token the grammar refuses (only possible when
        something else masked every token it allowed, e.g. min_tokens hiding the EOS that
        was the only way out) leaves the matcher stopped, which ends the request."""
        self.num_consumed += 1
        was_broken = self.matcher.is_error()
        if not self.matcher.consume_token(token_id) and not was_broken:
            error = self.matcher.get_error().splitlines()
            logger.warning(
                "request %s: token %d is outside its grammar, ending it: %s",
                self.request_id,
                token_id,
                error[0] if error else "",
            )

    @property
    def is_finished(self) -> bool:
        """Nothing may follow (the grammar is complete, or a token broke it): the request ends."""
        return self.matcher.is_stopped()
