"""EAGLE drafts for the tiny checkpoints (tests.checkpoints): random ones written in each layout
the loader reads (engine/spec_decode/eagle_checkpoint.py), and one trained on a target that
follows a cycle, so that its drafts agree with the target where a random one's do not."""

from __future__ import annotations

from pathlib import Path

import torch

from engine.llm import LLM
from engine.spec_decode.eagle_checkpoint import EagleLayout, save_eagle_draft
from engine.spec_decode.eagle_draft import EagleDraft, EagleDraftShape
from engine.spec_decode.eagle_training import (
    DraftTraining,
    new_draft,
    sequence_features,
    served_embedding_weight,
    train_draft,
)
from engine.spec_decode.medusa_training import greedy_sequences, served_lm_head_weight
from tests.checkpoints import tiny_config
from tests.engine.spec_decode.medusa_heads import cycle_snippet, make_cycling_checkpoint

MAX_POSITIONS = 1024  # tests.checkpoints' models


def random_draft(
    seed: int = 0,
    fc_bias: bool = True,
    layernorms: bool = False,
    own_embedding: bool = False,
    own_lm_head: bool = False,
) -> EagleDraft:
    """A one-layer draft for tests.checkpoints' targets, weights spread as theirs are."""
    layer_config = tiny_config("LlamaForCausalLM", num_hidden_layers=1)
    shape = EagleDraftShape.from_layer_config(layer_config, 1, fc_bias, layernorms, own_embedding, own_lm_head)
    torch.manual_seed(seed)
    draft = EagleDraft(shape, MAX_POSITIONS, layer_config, torch.float32)
    with torch.no_grad():
        for name, param in draft.named_parameters():
            if param.dim() >= 2:
                param.normal_(0.0, 0.25)
            else:
                param.normal_(1.0 if name.endswith("layernorm.weight") else 0.0, 0.1)
    return draft


def make_eagle_draft(directory: Path, layout: EagleLayout, **options: bool) -> Path:
    save_eagle_draft(random_draft(**options), directory, layout, {})  # type: ignore[arg-type]
    return directory


def make_cycle_drafts(directory: Path, num_steps: int = 60) -> tuple[Path, list[int], Path, Path]:
    """The cycling target (tests.engine.spec_decode.medusa_heads), an EAGLE draft trained on its
    greedy continuations (engine/spec_decode/eagle_training.py) and the same draft untrained.
    Returns the target's folder, its cycle, the trained draft's folder and the untrained one's."""
    target, cycle = make_cycling_checkpoint(directory / "target")
    llm = LLM(model=str(target), dtype="float32", kv_cache_memory=1 << 22)
    prompts = [cycle_snippet(cycle, start, 6) for start in range(0, len(cycle), 3)]
    sequences = greedy_sequences(llm, prompts, 40)
    features = [sequence_features(llm, sequence) for sequence in sequences]
    runner = llm.engine.runner
    draft = new_draft(runner.hf_config, 1, MAX_POSITIONS)
    untrained, trained = directory / "untrained", directory / "trained"
    save_eagle_draft(draft, untrained, "eagle", {})
    embed_weight = served_embedding_weight(llm)
    train_draft(
        draft, sequences, features, embed_weight, served_lm_head_weight(llm), DraftTraining(num_steps=num_steps)
    )
    save_eagle_draft(draft, trained, "eagle", {})
    llm.close()
    return target, cycle, trained, untrained
