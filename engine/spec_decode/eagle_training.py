"""An EAGLE draft for a checkpoint nobody publishes one for, by self-distillation on this machine.

The data are Medusa training's (engine/spec_decode/medusa_training.py): the target's own greedy
continuations, run back through the engine's forward pass for the feature of every position
(:func:`sequence_features`). The draft then learns, at each position ``i``, from
``(t_{i + 1}, f_i)``, to output the next feature ``f_{i + 1}`` (smooth L1, EAGLE's regression)
and through the target's frozen LM head the token ``t_{i + 2}`` (cross-entropy), over whole
sequences at a time so its attention sees the context it will see when serving. The data's
shards, the loop, its saved state and the held-out score are EAGLE-3's too
(engine/spec_decode/draft_training.py), so an interrupted run resumes where it stopped.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from transformers import PretrainedConfig

from engine.llm import LLM
from engine.spec_decode.draft_training import (
    SelfDistillation,
    TrainedDraft,
    entry_outputs,
    init_draft_weights,
    new_layer_config,
    scored,
    served_embedding_weight,
    split_heldout,
    train_steps,
    training_sequences,
)
from engine.spec_decode.eagle_draft import EagleDraft, EagleDraftShape
from engine.spec_decode.medusa_training import Progress, final_hidden, no_progress, served_lm_head_weight


@dataclass(slots=True)
class DraftTraining(SelfDistillation):
    num_layers: int = 1
    feature_loss_weight: float = 1.0  # the regression's weight beside the token loss


def train_eagle(
    llm: LLM, prompts: list[list[int]], settings: DraftTraining, work: Path, progress: Progress = no_progress
) -> TrainedDraft[EagleDraft]:
    """A draft for ``llm``'s model from its greedy continuations of ``prompts`` (module docstring);
    a fraction of the sequences is held out and scored. Resumable as Medusa training is: shards
    of sequences and features, then the training state, in ``work``."""
    hidden_size = llm.engine.runner.shape.hidden_size
    sequences, features = training_sequences(
        llm, prompts, settings, "eagle-data", lambda s: sequence_features(llm, s), hidden_size, work, progress
    )
    heldout, train = split_heldout(len(sequences), settings, "EAGLE")
    draft = new_draft(llm.engine.runner.hf_config, settings.num_layers, llm.engine.max_model_len, settings.seed)
    embed_weight, lm_head_weight = served_embedding_weight(llm), served_lm_head_weight(llm)
    train_draft(
        draft,
        [sequences[i] for i in train],
        [features[i] for i in train],
        embed_weight,
        lm_head_weight,
        settings,
        work / "eagle_train_state.pt",
        progress,
    )
    return scored(draft, sequences, features, train, heldout, embed_weight, _lm_head(lm_head_weight))


def new_draft(target_config: PretrainedConfig, num_layers: int, max_positions: int, seed: int = 0) -> EagleDraft:
    """A float32 draft shaped like the target's layers (EAGLE-1's: fc with a bias, the target's
    embedding and LM head), small random weights."""
    layer_config = new_layer_config(target_config, num_layers)
    shape = EagleDraftShape.from_layer_config(
        layer_config, num_layers, fc_bias=True, layernorms=False, own_embedding=False, own_lm_head=False
    )
    draft = EagleDraft(shape, max_positions, layer_config, torch.float32)
    init_draft_weights(draft, seed)
    return draft


def sequence_features(llm: LLM, sequence: list[int]) -> torch.Tensor:
    """The target's feature (final normed hidden state) at every position of ``sequence``,
    [len(sequence), hidden_size] float32, as the engine serves it."""
    return final_hidden(llm, sequence, np.arange(len(sequence)))


def train_draft(
    draft: EagleDraft,
    sequences: list[list[int]],
    features: list[torch.Tensor],
    embed_weight: torch.Tensor,
    lm_head_weight: torch.Tensor,
    settings: DraftTraining,
    state_path: Path | None = None,
    progress: Progress = no_progress,
) -> float:
    """Train ``draft`` in place on ``sequences`` and their ``features`` (each [len, hidden]) with
    the target's frozen ``embed_weight`` and ``lm_head_weight`` (draft_training.train_steps: the
    steps, the saved state). Returns the last step's loss (0 when no step was left)."""

    def loss_of(index: int) -> torch.Tensor:
        sequence, sequence_features_ = sequences[index], features[index]
        outputs = entry_outputs(draft, sequence, sequence_features_, embed_weight)[:-1]
        token_loss = F.cross_entropy(draft.logits(outputs, _lm_head(lm_head_weight)), torch.tensor(sequence[2:]))
        feature_loss = F.smooth_l1_loss(outputs, sequence_features_[1 : len(sequence) - 1])
        return token_loss + settings.feature_loss_weight * feature_loss

    return train_steps(draft, sequences, loss_of, settings, "EAGLE", state_path, progress)


def _lm_head(lm_head_weight: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
    return lambda x: x @ lm_head_weight.T
