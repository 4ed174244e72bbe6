"""Which prefill rank each decode rank pulls which KV heads from, when the two instances
split the model's KV heads differently (tensor parallelism of different sizes).

Each rank's cache holds its own KV heads of every block (engine/tensor_parallel/layout.py),
so a decode rank needs, for each of its heads, a prefill rank that holds that head: it pulls
exactly those heads of the missing blocks from that rank, and nothing passes through a third
rank. Where a head is replicated on several prefill ranks (more ranks than KV heads), the
decode rank takes it from the replica whose index matches its own, so pulls spread over the
replicas instead of all landing on the first.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.tensor_parallel.layout import kv_head_range


@dataclass(frozen=True, slots=True)
class HeadSpan:
    """Heads ``source_start .. source_start + num_heads`` of a prefill rank's local heads land
    at ``target_start ..`` of the decode rank's."""

    source_rank: int
    source_start: int
    target_start: int
    num_heads: int


def plan_head_pulls(num_kv_heads: int, source_size: int, target_size: int) -> list[list[HeadSpan]]:
    """For each decode rank (``target_size`` of them), the spans it pulls, in its head order.
    Consecutive heads held by one prefill rank travel as one span."""
    plans: list[list[HeadSpan]] = []
    for target_rank in range(target_size):
        target_heads = kv_head_range(target_rank, target_size, num_kv_heads)
        spans: list[HeadSpan] = []
        for offset, head in enumerate(target_heads):
            holders = [r for r in range(source_size) if head in kv_head_range(r, source_size, num_kv_heads)]
            source_rank = holders[target_rank % len(holders)]
            source_start = head - kv_head_range(source_rank, source_size, num_kv_heads).start
            last = spans[-1] if spans else None
            if (
                last is not None
                and last.source_rank == source_rank
                and last.source_start + last.num_heads == source_start
                and last.target_start + last.num_heads == offset
            ):
                spans[-1] = HeadSpan(source_rank, last.source_start, last.target_start, last.num_heads + 1)
            else:
                spans.append(HeadSpan(source_rank, source_start, offset, 1))
        plans.append(spans)
    return plans
