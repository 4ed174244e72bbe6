"""The layer plan: for every pair of shapes (TP x PP, any stage split), every decode rank gets
each (layer, KV head) it holds exactly once, from a prefill rank that holds that pair."""

from __future__ import annotations

import itertools

import pytest

from engine.pipeline_parallel.stages import plan_stages
from engine.tensor_parallel.layout import kv_head_range
from kv_connector.layer_plan import KVLayout, KVSpan, plan_kv_pulls, stage_first_layers


def layouts(num_layers: int, num_kv_heads: int) -> list[KVLayout]:
    """Every split of ``num_layers`` into 1..3 stages (equal or not), at the tensor-parallel
    sizes that split ``num_kv_heads`` (divisors and multiples up to twice the heads)."""
    sizes = [n for n in range(1, 2 * num_kv_heads + 1) if num_kv_heads % n == 0 or n % num_kv_heads == 0]
    splits: set[tuple[int, ...]] = set()
    for num_stages in range(1, min(3, num_layers) + 1):
        for cuts in itertools.combinations(range(1, num_layers), num_stages - 1):
            splits.add((0, *cuts))
    return [KVLayout(num_layers, size, firsts) for size in sizes for firsts in sorted(splits)]


def held(layout: KVLayout, rank: int, num_kv_heads: int) -> tuple[range, range]:
    """The (layers, heads) of the model that ``layout``'s rank ``rank`` holds."""
    stage, tensor_rank = divmod(rank, layout.tensor_parallel_size)
    return layout.stage_layers()[stage], kv_head_range(tensor_rank, layout.tensor_parallel_size, num_kv_heads)


@pytest.mark.parametrize(("num_layers", "num_kv_heads"), [(1, 2), (2, 4), (3, 1), (4, 2), (5, 3)])
def test_every_decode_rank_gets_each_layer_and_head_once_from_a_holder(num_layers: int, num_kv_heads: int) -> None:
    shapes = layouts(num_layers, num_kv_heads)
    for source, target in itertools.product(shapes, repeat=2):
        plans = plan_kv_pulls(num_kv_heads, source, target)
        assert len(plans) == target.num_ranks
        for target_rank, spans in enumerate(plans):
            target_layers, target_heads = held(target, target_rank, num_kv_heads)
            received = []
            for span in spans:
                assert 0 <= span.source_rank < source.num_ranks
                source_layers, source_heads = held(source, span.source_rank, num_kv_heads)
                for i, j in itertools.product(range(span.num_layers), range(span.num_heads)):
                    layer = source_layers.start + span.source_layer_start + i
                    head = source_heads.start + span.source_head_start + j
                    assert layer in source_layers and head in source_heads, (source, target, span)
                    # Where it lands in the D rank's cache is where D keeps that (layer, head).
                    assert target_layers[span.target_layer_start + i] == layer, (source, target, span)
                    assert target_heads[span.target_head_start + j] == head, (source, target, span)
                    received.append((layer, head))
            wanted = list(itertools.product(target_layers, target_heads))
            assert sorted(received) == wanted, (source, target, target_rank)


def test_the_usual_pairs() -> None:
    # 4 layers, 4 KV heads. P at PP 2 -> D at PP 1: D's one rank takes layers 0-1 from P's
    # stage 0 (rank 0) and 2-3 from its stage 1 (rank 1), all heads each.
    assert plan_kv_pulls(4, KVLayout(4, 1, (0, 2)), KVLayout(4)) == [
        [KVSpan(0, 0, 0, 2, 0, 0, 4), KVSpan(1, 0, 2, 2, 0, 0, 4)]
    ]
    # P at PP 1 -> D at PP 2: each D stage takes its layers of P's one rank.
    assert plan_kv_pulls(4, KVLayout(4), KVLayout(4, 1, (0, 2))) == [
        [KVSpan(0, 0, 0, 2, 0, 0, 4)],
        [KVSpan(0, 2, 0, 2, 0, 0, 4)],
    ]
    # P at TP 2 -> D at PP 2: each D stage takes its layers, two heads from each of P's ranks.
    assert plan_kv_pulls(4, KVLayout(4, 2), KVLayout(4, 1, (0, 2))) == [
        [KVSpan(0, 0, 0, 2, 0, 0, 2), KVSpan(1, 0, 0, 2, 0, 2, 2)],
        [KVSpan(0, 2, 0, 2, 0, 0, 2), KVSpan(1, 2, 0, 2, 0, 2, 2)],
    ]
    # Splits that overlap unevenly: P stages 0-2 / 3, D stages 0 / 1-3.
    assert plan_kv_pulls(4, KVLayout(4, 1, (0, 3)), KVLayout(4, 1, (0, 1))) == [
        [KVSpan(0, 0, 0, 1, 0, 0, 4)],
        [KVSpan(0, 1, 0, 2, 0, 0, 4), KVSpan(1, 0, 2, 1, 0, 0, 4)],
    ]


def test_same_shape_is_rank_to_rank_whole() -> None:
    layout = KVLayout(6, 2, (0, 3))
    assert plan_kv_pulls(4, layout, layout) == [[KVSpan(rank, 0, 0, 3, 0, 0, 2)] for rank in range(4)]


def test_stage_first_layers_follow_the_stage_split() -> None:
    for counts in [(10, 10, 10), (4, 3), (1,)]:
        stages = plan_stages(sum(counts), len(counts), counts)
        assert stage_first_layers(list(counts)) == tuple(stage.layers.start for stage in stages)


@pytest.mark.parametrize(
    ("layout", "fault"),
    [
        (KVLayout(4, 1, (1, 2)), "must start at layer 0"),
        (KVLayout(4, 1, (0, 2, 2)), "at least one of the 4 layers"),
        (KVLayout(4, 1, (0, 4)), "at least one of the 4 layers"),
        (KVLayout(4, 0), "tensor parallel size 0"),
    ],
)
def test_a_split_the_model_cannot_take_is_refused(layout: KVLayout, fault: str) -> None:
    assert fault in (layout.error() or "")
    with pytest.raises(ValueError, match=fault):
        plan_kv_pulls(2, layout, KVLayout(4))
    with pytest.raises(ValueError, match=fault):
        plan_kv_pulls(2, KVLayout(4), layout)
