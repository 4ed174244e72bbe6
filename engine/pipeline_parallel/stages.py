"""Which layers each pipeline stage holds.

An instance at ``--pipeline-parallel-size N`` splits its decoder layers into N contiguous
stages. By default the stages are as equal as the layer count allows, the extra layers going
to the stages before the last (the last one also runs the final norm and the LM head, and
samples; vLLM splits the same way); ``--pipeline-stage-layers 10,10,10`` names each stage's
count instead. The first stage alone embeds the tokens, the last alone computes logits.
A split that cannot be made (more stages than layers, counts that do not add up to the model's
layers) is refused with a ValueError naming the counts, before any rank process starts.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class PipelineStage:
    """One stage of a model split into ``num_stages``: stage ``index`` holds ``layers`` (the
    model's layer numbers)."""

    index: int
    num_stages: int
    layers: range

    @classmethod
    def whole(cls, num_layers: int) -> PipelineStage:
        """The whole model in one process (no pipeline parallelism)."""
        return cls(0, 1, range(num_layers))

    @property
    def is_first(self) -> bool:
        """Embeds the tokens."""
        return self.index == 0

    @property
    def is_last(self) -> bool:
        """Computes the logits (the engine's own process: it samples)."""
        return self.index == self.num_stages - 1

    @property
    def is_whole(self) -> bool:
        return self.num_stages == 1

    def holds(self, name: str) -> bool:
        """Whether this stage loads checkpoint tensor ``name`` (a Hugging Face name): its layers',
        the embedding on the first stage, the LM head on the last, the final norm on every one
        (it is one row of weights)."""
        name = name.removeprefix("model.")
        if name.startswith("layers."):
            return int(name.split(".", 2)[1]) in self.layers
        if name.startswith("embed_tokens."):
            return self.is_first
        if name.startswith("lm_head."):
            return self.is_last
        return True


def plan_stages(num_layers: int, num_stages: int, stage_layers: tuple[int, ...] | None = None) -> list[PipelineStage]:
    """The stages of a model of ``num_layers`` layers, in order; ``stage_layers``: each stage's
    layer count as the user gave it (None: as equal as possible)."""
    if num_stages < 1:
        raise ValueError(f"--pipeline-parallel-size must be at least 1, got {num_stages}")
    if stage_layers is None:
        if num_stages > num_layers:
            raise ValueError(
                f"--pipeline-parallel-size {num_stages} is more than the model's {num_layers} layers: every stage "
                f"needs at least one; choose at most {num_layers}"
            )
        counts = [num_layers // num_stages] * num_stages
        for stage in range(num_layers % num_stages):
            counts[num_stages - 2 - stage] += 1
    else:
        counts = list(stage_layers)
        if len(counts) != num_stages:
            raise ValueError(
                f"--pipeline-stage-layers names {len(counts)} stages, --pipeline-parallel-size is {num_stages}: "
                "give one layer count per stage"
            )
        if min(counts) < 1:
            raise ValueError(f"--pipeline-stage-layers {_spelled(counts)}: every stage needs at least one layer")
        if sum(counts) != num_layers:
            raise ValueError(
                f"--pipeline-stage-layers {_spelled(counts)} adds up to {sum(counts)} layers, the model has "
                f"{num_layers}: the counts must add up to it"
            )
    stages, start = [], 0
    for index, count in enumerate(counts):
        stages.append(PipelineStage(index, num_stages, range(start, start + count)))
        start += count
    return stages


def _spelled(counts: list[int]) -> str:
    return ",".join(str(count) for count in counts)
