"""How many tokens of one long prompt a step computes when the cap is ``"auto"``.

A prompt that arrives while a long one is being prefilled waits for the step in flight,
then shares the next step with the long prompt's following chunk (engine/scheduler.py,
``long_prefill_token_threshold``). So the chunk's duration, not its token count, is what
bounds that wait, and the same count means very different durations on different hardware:
seconds for a 1,024-token prompt on one CPU core, milliseconds on a GPU.
"auto" sizes the chunk from the engine's measured prefill rate so that it takes about
:data:`AUTO_CHUNK_SECONDS`, never below :data:`MIN_AUTO_CHUNK_TOKENS` (smaller chunks
re-read the weights too often for what they compute), and no cap at all where that duration
holds a whole step's budget (a GPU). The chunking's cost and what it buys: docs/benchmarks.md,
"Prompt chunks capped on the prefill instance".
"""

from __future__ import annotations

from engine.kv_cache_utils import cdiv

AUTO_CHUNK_SECONDS = 0.5
MIN_AUTO_CHUNK_TOKENS = 256


def auto_long_prefill_threshold(
    prefill_tokens_per_s: float, block_size: int, max_num_batched_tokens: int
) -> int | None:
    """The cap for this measured rate, in whole blocks; None (no cap) while the rate is not
    measured yet or when the cap would not be below the step budget."""
    if prefill_tokens_per_s <= 0:
        return None
    num_tokens = max(MIN_AUTO_CHUNK_TOKENS, int(prefill_tokens_per_s * AUTO_CHUNK_SECONDS))
    num_tokens = cdiv(num_tokens, block_size) * block_size
    return num_tokens if num_tokens < max_num_batched_tokens else None
