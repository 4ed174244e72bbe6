"""An EAGLE draft for a checkpoint nobody publishes one for, by self-distillation on this machine.

The data are Medusa training's (engine/spec_decode/medusa_training.py): the target's own greedy
continuations, run back through the engine's forward pass for the feature of every position
(:func:`sequence_features`). The draft then learns, at each position ``i``, from
``(t_{i + 1}, f_i)``, to output the next feature ``f_{i + 1}`` (smooth L1, EAGLE's regression)
and through the target's frozen LM head the token ``t_{i + 2}`` (cross-entropy), over whole
sequences at a time so its attention sees the context it will see when serving. Shards of
sequences and features, and the training state, are saved as Medusa training saves its own
(shared helpers there), so an interrupted run resumes where it stopped.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from transformers import LlamaConfig, PretrainedConfig

from engine.llm import LLM
from engine.spec_decode.eagle_draft import EagleDraft, EagleDraftShape, new_draft_kv
from engine.spec_decode.medusa_training import (
    Progress,
    cached_shards,
    final_hidden,
    greedy_sequences,
    no_progress,
    resume_training,
    save_training,
    served_lm_head_weight,
)

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class DraftTraining:
    num_layers: int = 1
    max_new_tokens: int = 128  # each prompt's greedy continuation
    num_steps: int = 200
    sequences_per_step: int = 4
    learning_rate: float = 3e-3
    feature_loss_weight: float = 1.0  # the regression's weight beside the token loss
    heldout_fraction: float = 0.05
    prompts_per_shard: int = 16
    checkpoint_every: int = 50
    seed: int = 0


@dataclass(slots=True)
class TrainedDraft:
    draft: EagleDraft
    num_sequences: int
    num_positions: int  # entries trained on
    heldout_top1_accuracy: float  # the first draft's, on sequences never trained on
    num_heldout_positions: int


def train_eagle(
    llm: LLM, prompts: list[list[int]], settings: DraftTraining, work: Path, progress: Progress = no_progress
) -> TrainedDraft:
    """A draft for ``llm``'s model from its greedy continuations of ``prompts`` (module docstring);
    a fraction of the sequences is held out and scored. Resumable as Medusa training is: shards
    of sequences and features, then the training state, in ``work``."""
    sequences, features = _training_sequences(llm, prompts, settings, work, progress)
    if len(sequences) < 2:
        raise ValueError("EAGLE training needs at least two prompts whose continuations reach three tokens")
    num_heldout = min(len(sequences) - 1, max(1, round(len(sequences) * settings.heldout_fraction)))
    order = torch.randperm(len(sequences), generator=torch.Generator().manual_seed(settings.seed)).tolist()
    heldout, train = order[:num_heldout], order[num_heldout:]
    runner = llm.engine.runner
    draft = new_draft(runner.hf_config, settings.num_layers, llm.engine.max_model_len, settings.seed)
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
    accuracy, num_scored = evaluate_draft(
        draft, [sequences[i] for i in heldout], [features[i] for i in heldout], embed_weight, lm_head_weight
    )
    return TrainedDraft(
        draft,
        num_sequences=len(train),
        num_positions=sum(len(sequences[i]) - 1 for i in train),
        heldout_top1_accuracy=accuracy,
        num_heldout_positions=num_scored,
    )


def _training_sequences(
    llm: LLM, prompts: list[list[int]], settings: DraftTraining, work: Path, progress: Progress
) -> tuple[list[list[int]], list[torch.Tensor]]:
    """The greedy sequences of three tokens or more, and their features, shard by shard."""

    def make(shard_prompts: list[list[int]]) -> dict[str, torch.Tensor]:
        sequences = [s for s in greedy_sequences(llm, shard_prompts, settings.max_new_tokens) if len(s) >= 3]
        hidden_size = llm.engine.runner.shape.hidden_size
        return {
            "token_ids": torch.tensor([t for s in sequences for t in s], dtype=torch.int64),
            "lengths": torch.tensor([len(s) for s in sequences], dtype=torch.int64),
            "features": torch.cat([sequence_features(llm, s) for s in sequences])
            if sequences
            else torch.empty(0, hidden_size),
        }

    sequences: list[list[int]] = []
    features: list[torch.Tensor] = []
    for _, shard in cached_shards(work, "eagle-data", prompts, settings.prompts_per_shard, make, progress):
        lengths = shard["lengths"].tolist()
        sequences += [chunk.tolist() for chunk in shard["token_ids"].split(lengths)]
        features += list(shard["features"].split(lengths))
    return sequences, features


def served_embedding_weight(llm: LLM) -> torch.Tensor:
    """The target's embedding as served, [vocab, hidden_size] float32 (the module applied to
    every token id, whatever its storage)."""
    runner = llm.engine.runner
    with torch.inference_mode():
        rows = runner.model.embed_tokens(torch.arange(runner.shape.vocab_size, device=runner.device)).float()
    return rows.clone().cpu()  # a plain tensor (not an inference one): autograd may save it


@torch.no_grad()
def evaluate_draft(
    draft: EagleDraft,
    sequences: list[list[int]],
    features: list[torch.Tensor],
    embed_weight: torch.Tensor,
    lm_head_weight: torch.Tensor,
) -> tuple[float, int]:
    """The first draft's top-1 accuracy over ``sequences`` (every entry with a token two ahead),
    and how many entries were scored."""
    num_right = num_scored = 0
    for sequence, sequence_features_ in zip(sequences, features):
        if len(sequence) < 3:
            continue
        logits = _entry_logits(draft, sequence, sequence_features_, embed_weight, lm_head_weight)[0]
        num_right += int((logits.argmax(-1) == torch.tensor(sequence[2:])).sum())
        num_scored += len(sequence) - 2
    return (num_right / num_scored if num_scored else 0.0), num_scored


def new_draft(target_config: PretrainedConfig, num_layers: int, max_positions: int, seed: int = 0) -> EagleDraft:
    """A float32 draft shaped like the target's layers (EAGLE-1's: fc with a bias, the target's
    embedding and LM head), small random weights."""
    layer_config = LlamaConfig(
        **{
            key: value
            for key, value in target_config.to_dict().items()
            if key not in ("architectures", "model_type", "num_hidden_layers")
        },
        num_hidden_layers=num_layers,
    )
    shape = EagleDraftShape.from_layer_config(
        layer_config, num_layers, fc_bias=True, layernorms=False, own_embedding=False, own_lm_head=False
    )
    generator = torch.Generator().manual_seed(seed)
    draft = EagleDraft(shape, max_positions, layer_config, torch.float32)
    with torch.no_grad():
        for name, parameter in draft.named_parameters():
            if parameter.dim() >= 2:
                parameter.normal_(0.0, parameter.shape[1] ** -0.5, generator=generator)
            elif not name.endswith("layernorm.weight"):
                parameter.zero_()
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
    the target's frozen ``embed_weight`` and ``lm_head_weight``, for ``settings.num_steps`` steps
    in all: resumed from ``state_path`` and saved there every ``checkpoint_every`` steps, if given.
    Returns the last step's loss (0 when no step was left)."""
    usable = [i for i, sequence in enumerate(sequences) if len(sequence) >= 3]
    if not usable:
        raise ValueError("EAGLE training needs sequences of three tokens or more")
    optimizer = torch.optim.AdamW(draft.parameters(), lr=settings.learning_rate, weight_decay=0.0)
    sampler = torch.Generator().manual_seed(settings.seed)
    start = resume_training(state_path, "draft", draft, optimizer, sampler) if state_path is not None else 0
    draft.train()
    loss = torch.zeros(())
    for step in progress(range(start, settings.num_steps), "training", settings.num_steps - start):
        picks = torch.randint(len(usable), (settings.sequences_per_step,), generator=sampler).tolist()
        loss = torch.stack(
            [
                _loss(draft, sequences[usable[p]], features[usable[p]], embed_weight, lm_head_weight, settings)
                for p in picks
            ]
        ).mean()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        done = step + 1
        if state_path is not None and (done % settings.checkpoint_every == 0 or done == settings.num_steps):
            save_training(state_path, "draft", done, draft, optimizer, sampler)
    draft.eval()
    return float(loss.detach())


def _loss(
    draft: EagleDraft,
    sequence: list[int],
    features: torch.Tensor,
    embed_weight: torch.Tensor,
    lm_head_weight: torch.Tensor,
    settings: DraftTraining,
) -> torch.Tensor:
    logits, outputs = _entry_logits(draft, sequence, features, embed_weight, lm_head_weight)
    token_loss = F.cross_entropy(logits, torch.tensor(sequence[2:]))
    feature_loss = F.smooth_l1_loss(outputs, features[1 : len(sequence) - 1])
    return token_loss + settings.feature_loss_weight * feature_loss


def _entry_logits(
    draft: EagleDraft,
    sequence: list[int],
    features: torch.Tensor,
    embed_weight: torch.Tensor,
    lm_head_weight: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Entries 0 .. L-2 of one sequence (token i + 1 with feature i) in one pass; the logits and
    outputs of those with a token two ahead to guess, [L - 2, vocab] and [L - 2, hidden_size]."""
    token_ids = torch.tensor(sequence)
    num_entries = len(sequence) - 1
    outputs = draft(
        F.embedding(token_ids[1:], embed_weight),
        features[:num_entries],
        torch.arange(num_entries),
        [new_draft_kv(draft, 0, num_entries)],
        [num_entries],
    )[:-1]
    return draft.logits(outputs, lambda x: x @ lm_head_weight.T), outputs
