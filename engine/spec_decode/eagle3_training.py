"""An EAGLE-3 draft for a checkpoint nobody publishes one for, by self-distillation on this machine.

The data are EAGLE training's (engine/spec_decode/eagle_training.py): the target's own greedy
continuations, run back through the engine's forward pass, here for the residual streams entering
EAGLE-3's default layers at every position (:func:`layer_features`). The draft vocabulary is the
``draft_vocab_size`` tokens the continuations use most (EAGLE-3's own choice, by frequency), and
the draft's LM head starts from the target's rows for them. The draft learns, at each position
``i``, from ``(t_{i + 1}, a_i)`` the token ``t_{i + 2}`` (cross-entropy over its vocabulary; a
token outside it is skipped), and, unrolled once as its chains run (EAGLE-3's training-time test,
one step deep), from ``(t_{i + 2}``, its own output at ``i)`` the token ``t_{i + 3}``. The data's
shards, the loop, its saved state and the held-out score are EAGLE's
(engine/spec_decode/draft_training.py), so an interrupted run resumes where it stopped.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from transformers import PretrainedConfig

from engine.flat_batch import build_flat_batch
from engine.llm import LLM
from engine.spec_decode.draft_training import (
    SelfDistillation,
    TrainedDraft,
    entry_outputs,
    init_draft_weights,
    new_layer_config,
    run_entries,
    scored,
    served_embedding_weight,
    split_heldout,
    train_steps,
    training_sequences,
)
from engine.spec_decode.eagle3_checkpoint import default_feature_layer_ids
from engine.spec_decode.eagle3_draft import Eagle3Draft, Eagle3Shape
from engine.spec_decode.eagle_draft import EagleDraftShape
from engine.spec_decode.medusa_training import Progress, no_progress, served_lm_head_weight
from engine.teacher_forcing import borrowed_block_rows

_IGNORED = -100  # a target token outside the draft vocabulary: no loss


@dataclass(slots=True)
class Eagle3Training(SelfDistillation):
    draft_vocab_size: int = 8192  # at most: fewer when the continuations use fewer tokens


def train_eagle3(
    llm: LLM, prompts: list[list[int]], settings: Eagle3Training, work: Path, progress: Progress = no_progress
) -> TrainedDraft[Eagle3Draft]:
    """A draft for ``llm``'s model from its greedy continuations of ``prompts`` (module docstring);
    a fraction of the sequences is held out and scored. Resumable: shards of sequences and
    features, then the training state, in ``work``."""
    runner = llm.engine.runner
    layer_ids = default_feature_layer_ids(runner.shape.num_layers)
    if len(set(layer_ids)) != 3 or min(layer_ids) < 0:
        raise ValueError(f"EAGLE-3 reads 3 distinct layers of the target; {runner.shape.num_layers} layers are too few")
    width = len(layer_ids) * runner.shape.hidden_size
    sequences, features = training_sequences(
        llm, prompts, settings, "eagle3-data", lambda s: layer_features(llm, s, layer_ids), width, work, progress
    )
    heldout, train = split_heldout(len(sequences), settings, "EAGLE-3")
    vocabulary = draft_vocabulary([sequences[i] for i in train], settings.draft_vocab_size)
    draft = new_eagle3_draft(runner.hf_config, vocabulary, layer_ids, llm.engine.max_model_len, settings.seed)
    with torch.no_grad():
        draft.lm_head.weight.copy_(served_lm_head_weight(llm)[torch.tensor(vocabulary)])
    embed_weight = served_embedding_weight(llm)
    train_eagle3_draft(
        draft,
        [sequences[i] for i in train],
        [features[i] for i in train],
        embed_weight,
        settings,
        work / "eagle3_train_state.pt",
        progress,
    )
    # EAGLE-3 drafts with its own LM head: the target's is never asked for.
    return scored(draft, sequences, features, train, heldout, embed_weight, lambda x: x)


def layer_features(llm: LLM, sequence: list[int], layer_ids: tuple[int, ...]) -> torch.Tensor:
    """The residual streams entering the target's ``layer_ids`` at every position of ``sequence``,
    side by side, [len(sequence), len(layer_ids) * hidden_size] float32, as the engine serves them
    (through its paged KV cache, borrowed for the pass: engine/teacher_forcing.py)."""
    engine = llm.engine
    runner = engine.runner
    model = runner.model
    with borrowed_block_rows(engine, 1, len(sequence)) as block_rows:
        batch = build_flat_batch(
            sequence,
            np.array([len(sequence)]),
            np.array([0]),
            block_rows,
            np.ones(1, dtype=bool),
            0,
            runner.block_size,
            runner.to_device,
        )
        with torch.inference_mode():
            _, _, features = model.run_layers_capturing(
                batch.positions, model.embed_tokens(batch.input_ids), runner.layer_caches, batch.metadata, layer_ids
            )
    return features.float().cpu().clone()  # a plain tensor (not an inference one): autograd may save it


def draft_vocabulary(sequences: list[list[int]], max_size: int) -> list[int]:
    """The ``max_size`` tokens the sequences use most (fewer if they use fewer), ascending."""
    counts = Counter(t for sequence in sequences for t in sequence)
    return sorted(token for token, _ in counts.most_common(max_size))


def new_eagle3_draft(
    target_config: PretrainedConfig,
    vocabulary: list[int],
    layer_ids: tuple[int, ...],
    max_positions: int,
    seed: int = 0,
) -> Eagle3Draft:
    """A float32 one-layer draft shaped like the target's layers, drafting in ``vocabulary``
    (target ids, ascending), small random weights."""
    layer_config = new_layer_config(target_config, 1)
    shape = EagleDraftShape.from_layer_config(layer_config, 1, False, False, own_embedding=False, own_lm_head=True)
    eagle3 = Eagle3Shape(len(vocabulary), shape.hidden_size, layer_ids, norm_before_residual=False)
    draft = Eagle3Draft(shape, eagle3, max_positions, layer_config, torch.float32)
    init_draft_weights(draft, seed)
    with torch.no_grad():
        draft.d2t.copy_(torch.tensor(vocabulary) - torch.arange(len(vocabulary)))
    return draft


def train_eagle3_draft(
    draft: Eagle3Draft,
    sequences: list[list[int]],
    features: list[torch.Tensor],
    embed_weight: torch.Tensor,
    settings: Eagle3Training,
    state_path: Path | None = None,
    progress: Progress = no_progress,
) -> float:
    """Train ``draft`` in place on ``sequences`` and their ``features`` with the target's frozen
    ``embed_weight`` (draft_training.train_steps: the steps, the saved state). Returns the last
    step's loss."""
    to_draft = _to_draft(draft, embed_weight.shape[0])

    def loss_of(index: int) -> torch.Tensor:
        return _loss(draft, sequences[index], features[index], embed_weight, to_draft)

    return train_steps(draft, sequences, loss_of, settings, "EAGLE-3", state_path, progress)


def _to_draft(draft: Eagle3Draft, vocab_size: int) -> torch.Tensor:
    """Target id -> draft id [vocab_size], ``_IGNORED`` for the tokens the draft cannot name."""
    to_draft = torch.full((vocab_size,), _IGNORED, dtype=torch.int64)
    num_draft = draft.eagle3.draft_vocab_size
    to_draft[torch.arange(num_draft) + draft.d2t.cpu()] = torch.arange(num_draft)
    return to_draft


def _loss(
    draft: Eagle3Draft,
    sequence: list[int],
    features: torch.Tensor,
    embed_weight: torch.Tensor,
    to_draft: torch.Tensor,
) -> torch.Tensor:
    """The first drafts' loss over the whole sequence, plus the second's (one unrolled step)."""
    token_ids = torch.tensor(sequence)
    num_entries = len(sequence) - 1
    # Entry i: token i + 1 with the target's layers at i, guessing token i + 2.
    outputs = entry_outputs(draft, sequence, features, embed_weight)
    loss = _token_loss(draft.logits(outputs[:-1]), to_draft[token_ids[2:]])
    if num_entries >= 3:
        # As a chain runs: entry i + 1 reads token i + 2 with the draft's own output at i.
        unrolled = run_entries(draft, token_ids[2:], outputs[:-1], embed_weight, 1)
        loss = loss + _token_loss(draft.logits(unrolled[:-1]), to_draft[token_ids[3:]])
    return loss


def _token_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy over the targets the draft can name (0 when it can name none)."""
    total = F.cross_entropy(logits, targets, ignore_index=_IGNORED, reduction="sum")
    return total / (targets != _IGNORED).sum().clamp(min=1)
