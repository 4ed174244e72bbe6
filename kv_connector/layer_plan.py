"""Which prefill rank each decode rank pulls which (layers, KV heads) of every block from, when
the two instances split the model differently: tensor parallelism of different sizes (each rank
holds some KV heads of every layer: kv_connector/head_plan.py) and pipeline stages of different
splits (each stage's ranks hold their stage's layers alone: engine/pipeline_parallel/stages.py).

A rank's cache holds its heads of its stage's layers for every block, so a decode rank needs,
for each (layer, head) it holds, a prefill rank that holds that pair: the layers are the
intersection of the D rank's stage with each P stage, the heads the head plan's spans between
the two tensor-parallel sizes (replicas taken in turn, as there). Each (layer range, head span)
is one pull from one P rank, and nothing passes through a third rank.

Ranks are numbered in an instance's stage-major order, as its executor places them
(engine/tensor_parallel/executor.py): stage ``s``'s tensor-parallel rank ``t`` is rank
``s * tensor_parallel_size + t``; a KV handle lists the ranks' connector addresses in that order.
"""

from __future__ import annotations

from dataclasses import dataclass

from kv_connector.head_plan import plan_head_pulls


@dataclass(frozen=True, slots=True)
class KVLayout:
    """How an instance splits a block's KV: ``stage_first_layers`` (each stage's first layer,
    the first being 0) and ``tensor_parallel_size`` ranks per stage."""

    num_layers: int
    tensor_parallel_size: int = 1
    stage_first_layers: tuple[int, ...] = (0,)

    @property
    def num_stages(self) -> int:
        return len(self.stage_first_layers)

    @property
    def num_ranks(self) -> int:
        return self.num_stages * self.tensor_parallel_size

    def stage_layers(self) -> list[range]:
        """Each stage's layers, in order."""
        stops = [*self.stage_first_layers[1:], self.num_layers]
        return [range(first, stop) for first, stop in zip(self.stage_first_layers, stops, strict=True)]

    def error(self) -> str | None:
        """Why this split cannot be a model's of ``num_layers`` layers (None: it can)."""
        firsts = self.stage_first_layers
        if self.tensor_parallel_size < 1:
            return f"tensor parallel size {self.tensor_parallel_size}"
        if not firsts or firsts[0] != 0:
            return f"stages from layers {list(firsts)}: the first stage must start at layer 0"
        if any(b <= a for a, b in zip(firsts, firsts[1:], strict=False)) or firsts[-1] >= self.num_layers:
            return f"stages from layers {list(firsts)}: each must hold at least one of the {self.num_layers} layers"
        return None

    def describe(self) -> str:
        """``TP 2 x PP 2 (stages from layers 0, 3)``, as a refusal names a side's shape."""
        firsts = ", ".join(str(first) for first in self.stage_first_layers)
        return f"TP {self.tensor_parallel_size} x PP {self.num_stages} (stages from layers {firsts})"


def stage_first_layers(stage_layer_counts: list[int]) -> tuple[int, ...]:
    """Each stage's first layer, from each stage's layer count: (10, 10, 8) -> (0, 10, 20)."""
    firsts, start = [], 0
    for count in stage_layer_counts:
        firsts.append(start)
        start += count
    return tuple(firsts)


@dataclass(frozen=True, slots=True)
class KVSpan:
    """Layers ``source_layer_start ..`` (of P rank ``source_rank``'s own layers) and heads
    ``source_head_start ..`` (of its own heads) land at ``target_layer_start ..`` and
    ``target_head_start ..`` of the decode rank's."""

    source_rank: int
    source_layer_start: int
    target_layer_start: int
    num_layers: int
    source_head_start: int
    target_head_start: int
    num_heads: int


def plan_kv_pulls(num_kv_heads: int, source: KVLayout, target: KVLayout) -> list[list[KVSpan]]:
    """For each decode rank (``target.num_ranks``, stage-major), the spans it pulls: by layer
    range, then in its head order. Together they cover each of its (layer, head) pairs once."""
    if source.num_layers != target.num_layers:
        raise ValueError(f"a model of {source.num_layers} layers cannot feed one of {target.num_layers}")
    for layout in (source, target):
        if (error := layout.error()) is not None:
            raise ValueError(f"not a split of {layout.num_layers} layers: {error}")
    head_plans = plan_head_pulls(num_kv_heads, source.tensor_parallel_size, target.tensor_parallel_size)
    source_stages = source.stage_layers()
    plans: list[list[KVSpan]] = []
    for target_stage in target.stage_layers():
        for target_tensor_rank in range(target.tensor_parallel_size):
            spans: list[KVSpan] = []
            for source_stage_index, source_stage in enumerate(source_stages):
                first = max(source_stage.start, target_stage.start)
                stop = min(source_stage.stop, target_stage.stop)
                if first >= stop:
                    continue
                spans += [
                    KVSpan(
                        source_rank=source_stage_index * source.tensor_parallel_size + heads.source_rank,
                        source_layer_start=first - source_stage.start,
                        target_layer_start=first - target_stage.start,
                        num_layers=stop - first,
                        source_head_start=heads.source_start,
                        target_head_start=heads.target_start,
                        num_heads=heads.num_heads,
                    )
                    for heads in head_plans[target_tensor_rank]
                ]
            plans.append(spans)
    return plans
