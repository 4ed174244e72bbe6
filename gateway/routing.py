"""How the gateway ranks the instances that may take a request (``--routing``).

``load``: lowest ``4 * (waiting + dispatched) + running`` (``InstanceState.score``).

``kv`` (cache-aware; needs the prefix index, ``gateway/prefix_index.py``):

- prefill (and colocated) instance ``i``, in seconds until the request's prefill is done::

      cost_P(i) = (queued_i + prompt - hit_i + EVICTION_WEIGHT * block_size * evicted_i) / rate_i

  ``queued_i``: prompt tokens it still has to compute (its report) plus those this gateway
  sent since (their uncached part); ``hit_i``: prompt tokens its prefix cache holds (the
  leading blocks of the request's hash chain found in the index, at most ``prompt - 1``: the
  last token is always computed); ``evicted_i``: the cached blocks the request's new blocks
  would push out there (new blocks beyond its free ones: its block count minus what the
  index holds for it), least recently used first, each counted by what its age says it
  is still worth, from 1 to 0 (``PrefixIndex.eviction_cost_blocks``,
  ``gateway/reuse_ages.py``), and weighed at ``EVICTION_WEIGHT`` times its recompute: the
  request that finds it gone computes it again (its TTFT pays) and in doing so pushes out
  live blocks in turn. At twice, an instance that measured a prefill rate twice the
  other's still took new prefixes it had no room for (the replay in
  tests/gateway/test_routing_replay.py); ``rate_i``: its
  measured prefill tokens/s (the mean of the measured ones for an instance that has none
  yet). Without the eviction term a prompt cached nowhere went to whichever idle instance
  measured the higher rate, every time: one instance held every prefix and thrashed while
  the other's cache stayed empty. With every eviction priced in full, two full instances
  cost the same for every new prefix and the first-ranked one took them all, evicting its
  own live prefixes while the other held only dead ones.

  Latency first: the eviction term may send a request to an instance other than the one
  that would finish its prefill soonest (the lowest ``cost_P`` without it) only if that
  instance would start it about as soon, or finish it about as soon: at most
  ``EQUALLY_SOON`` of the prompt's prefill on the soonest instance later. Sparing live
  blocks is worth a wait that every request after pays once, not one request queued behind
  another's long prompts: priced in full, the eviction term sent a new prefix to the busier
  instance, and that request was a run's slowest (6.1 s where ``load`` served it in 4.4 s).
  Idle instances start every prompt at once, so between them the eviction term decides as
  before, whatever their rates. An instance holding the prompt's prefix behind one prompt
  of its own starts later but finishes about as soon as an idle one that computes it all
  (3.98 against 3.71 s in a measured run): on the start alone it was passed over, and the
  idle one spent 3.7 s computing the prefix again and evicted live blocks for it.

- decode instance ``i``, in load units (one waiting request = 4, as in ``load``)::

      cost_D(i) = 4 * (waiting_i + dispatched_i) + running_i + 4 * new_blocks_i / max(free_i, 1)

  ``new_blocks_i``: blocks the request needs there beyond those its prefix cache already
  holds (fewer to pull, less memory taken); the last term is the share of the instance's
  free KV this request would take, worth one waiting request when it takes all of it (it
  would queue or preempt).

Ties go to the lower ``load`` score, then in this gateway's own order
(``gateway/tie_break.py``: several gateways must not herd). A prefill that finished re-prefilling keeps its
``prefer``-ence in :meth:`InstancePool.pick` whatever the mode.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from engine.kv_cache_utils import cdiv

# Waiting requests weigh more than running ones: each still needs its prefill (or its
# pull), while a running one costs only a share of the next decode step.
WAITING_WEIGHT = 4
# A live cached block pushed out costs more than its own recompute (see cost_P above).
EVICTION_WEIGHT = 3
# How much later than the soonest instance another may start or finish the prompt's prefill for
# the eviction term to choose it, as a share of the prompt's prefill on the soonest (see cost_P above).
EQUALLY_SOON = 0.25


def num_hit_tokens(num_hit_blocks: int, block_size: int, num_prompt_tokens: int) -> int:
    """Prompt tokens a prefix hit of ``num_hit_blocks`` saves; the last token is always computed."""
    return max(0, min(num_hit_blocks * block_size, num_prompt_tokens - 1))


def num_new_blocks(num_prompt_tokens: int, num_hit_blocks: int, block_size: int) -> int:
    """Blocks a decode instance must fill (pull) for the prompt beyond those it holds."""
    return max(0, cdiv(num_prompt_tokens, block_size) - num_hit_blocks)


@dataclass(frozen=True, slots=True)
class PrefillEstimate:
    """What sending a prompt to one prefill (or colocated) instance would take, in seconds."""

    wait_s: float  # before it starts the prompt: the tokens queued there / its rate
    compute_s: float  # the prompt's uncached tokens / its rate
    eviction_s: float  # EVICTION_WEIGHT * the tokens of live blocks it would push out / its rate

    @property
    def latency_s(self) -> float:
        return self.wait_s + self.compute_s

    @property
    def cost_s(self) -> float:
        return self.latency_s + self.eviction_s


def prefill_estimate(
    num_pending_tokens: int,
    prefill_tokens_per_s: float,
    num_uncached_tokens: int,
    num_evicted_tokens: float,
    fallback_rate: float,
) -> PrefillEstimate:
    rate = prefill_tokens_per_s if prefill_tokens_per_s > 0 else fallback_rate
    return PrefillEstimate(
        num_pending_tokens / rate, num_uncached_tokens / rate, EVICTION_WEIGHT * num_evicted_tokens / rate
    )


def prefill_costs_s(estimates: Sequence[PrefillEstimate]) -> list[float]:
    """Each instance's ``cost_P`` (lower is better), latency first: infinite for an instance
    the eviction term may not choose, one that would both start and finish the prompt's
    prefill later than the soonest-finishing instance by more than ``EQUALLY_SOON`` of the
    prompt's prefill there."""
    if not estimates:
        return []
    soonest = min(estimates, key=lambda e: e.latency_s)
    margin_s = EQUALLY_SOON * soonest.compute_s
    return [
        e.cost_s
        if e is soonest or e.wait_s <= soonest.wait_s + margin_s or e.latency_s <= soonest.latency_s + margin_s
        else math.inf
        for e in estimates
    ]


def decode_cost(num_waiting: int, num_running: int, num_new_blocks: int, num_free_blocks: int) -> float:
    return WAITING_WEIGHT * num_waiting + num_running + WAITING_WEIGHT * num_new_blocks / max(num_free_blocks, 1)
