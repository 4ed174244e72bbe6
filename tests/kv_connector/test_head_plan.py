"""The head plan: every decode rank gets each of its KV heads exactly once, from a prefill
rank that holds it, for every tensor-parallel pair the head counts allow; replicas share the
load; consecutive heads from one rank travel as one span."""

from __future__ import annotations

import itertools

import pytest

from engine.tensor_parallel.layout import kv_head_range
from kv_connector.head_plan import HeadSpan, plan_head_pulls


def sizes(num_kv_heads: int) -> list[int]:
    """Tensor parallel sizes that split ``num_kv_heads`` KV heads (divisors and multiples)."""
    return [n for n in range(1, 3 * num_kv_heads + 1) if num_kv_heads % n == 0 or n % num_kv_heads == 0]


@pytest.mark.parametrize("num_kv_heads", [1, 2, 3, 4, 8])
def test_every_decode_rank_gets_each_of_its_heads_once_from_a_holder(num_kv_heads: int) -> None:
    for source_size, target_size in itertools.product(sizes(num_kv_heads), repeat=2):
        for target_rank, spans in enumerate(plan_head_pulls(num_kv_heads, source_size, target_size)):
            wanted = kv_head_range(target_rank, target_size, num_kv_heads)
            received = []
            for span in spans:
                held = kv_head_range(span.source_rank, source_size, num_kv_heads)
                heads = range(held.start + span.source_start, held.start + span.source_start + span.num_heads)
                assert heads.stop <= held.stop, (source_size, target_size, span)
                received += [(span.target_start + i, head) for i, head in enumerate(heads)]
            assert sorted(received) == list(enumerate(wanted)), (source_size, target_size, spans)


def test_the_usual_pairs() -> None:
    # P at TP 2 -> D at TP 1, 4 KV heads: D takes two heads from each P rank.
    assert plan_head_pulls(4, 2, 1) == [[HeadSpan(0, 0, 0, 2), HeadSpan(1, 0, 2, 2)]]
    # P at TP 1 -> D at TP 2: each D rank takes its half of P's one rank.
    assert plan_head_pulls(4, 1, 2) == [[HeadSpan(0, 0, 0, 2)], [HeadSpan(0, 2, 0, 2)]]
    # Same size: rank to rank, whole blocks.
    assert plan_head_pulls(4, 2, 2) == [[HeadSpan(0, 0, 0, 2)], [HeadSpan(1, 0, 0, 2)]]
    # SmolLM2 (3 KV heads), P at TP 3 -> D at TP 1.
    assert plan_head_pulls(3, 3, 1) == [[HeadSpan(0, 0, 0, 1), HeadSpan(1, 0, 1, 1), HeadSpan(2, 0, 2, 1)]]


def test_replicated_heads_are_pulled_from_different_replicas() -> None:
    """2 KV heads on 4 prefill ranks (each head on two of them) -> 4 decode ranks: the two
    decode ranks that want head 0 pull it from its two replicas, not both from the first."""
    plans = plan_head_pulls(2, 4, 4)
    assert [spans[0].source_rank for spans in plans] == [0, 1, 2, 3]
