"""An EAGLE-3 draft for a checkpoint nobody publishes one for, by self-distillation on this machine.

The data are EAGLE training's (engine/spec_decode/eagle_training.py): the target's own greedy
continuations, run back through the engine's forward pass, here for the residual streams entering
EAGLE-3's default layers at every position (:func:`layer_features`). The draft vocabulary is the
``draft_vocab_size`` tokens the continuations use most (EAGLE-3's own choice, by frequency), and
the draft's LM head starts from the target's rows for them. The draft learns, at each position
``i``, from ``(t_{i + 1}, a_i)`` the token ``t_{i + 2}`` (cross-entropy over its vocabulary; a
token outside it is skipped), and, unrolled once as its chains run (EAGLE-3's training-time test,
one step deep), from ``(t_{i + 2}``, its own output at ``i)`` the token ``t_{i + 3}``. Shards of
sequences and features, and the training state, are saved as Medusa training saves its own, so an
interrupted run resumes where it stopped.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from transformers import LlamaConfig, PretrainedConfig

from engine.flat_batch import build_flat_batch
from engine.llm import LLM
from engine.spec_decode.eagle3_checkpoint import default_feature_layer_ids
from engine.spec_decode.eagle3_draft import Eagle3Draft, Eagle3Shape
from engine.spec_decode.eagle_draft import EagleDraftShape, new_draft_kv
from engine.spec_decode.eagle_training import served_embedding_weight
from engine.spec_decode.medusa_training import (
    Progress,
    cached_shards,
    greedy_sequences,
    no_progress,
    resume_training,
    save_training,
    served_lm_head_weight,
)
from engine.teacher_forcing import borrowed_block_rows

_IGNORED = -100  # a target token outside the draft vocabulary: no loss


@dataclass(slots=True)
class Eagle3Training:
    max_new_tokens: int = 128  # each prompt's greedy continuation
    num_steps: int = 200
    sequences_per_step: int = 4
    learning_rate: float = 3e-3
    draft_vocab_size: int = 8192  # at most: fewer when the continuations use fewer tokens
    heldout_fraction: float = 0.05
    prompts_per_shard: int = 16
    checkpoint_every: int = 50
    seed: int = 0


@dataclass(slots=True)
class TrainedEagle3:
    draft: Eagle3Draft
    num_sequences: int
    num_positions: int  # entries trained on
    heldout_top1_accuracy: float  # the first draft's, on sequences never trained on
    num_heldout_positions: int


def train_eagle3(
    llm: LLM, prompts: list[list[int]], settings: Eagle3Training, work: Path, progress: Progress = no_progress
) -> TrainedEagle3:
    """A draft for ``llm``'s model from its greedy continuations of ``prompts`` (module docstring);
    a fraction of the sequences is held out and scored. Resumable: shards of sequences and
    features, then the training state, in ``work``."""
    runner = llm.engine.runner
    layer_ids = default_feature_layer_ids(runner.shape.num_layers)
    if len(set(layer_ids)) != 3 or min(layer_ids) < 0:
        raise ValueError(f"EAGLE-3 reads 3 distinct layers of the target; {runner.shape.num_layers} layers are too few")
    sequences, features = _training_sequences(llm, prompts, settings, layer_ids, work, progress)
    if len(sequences) < 2:
        raise ValueError("EAGLE-3 training needs at least two prompts whose continuations reach three tokens")
    num_heldout = min(len(sequences) - 1, max(1, round(len(sequences) * settings.heldout_fraction)))
    order = torch.randperm(len(sequences), generator=torch.Generator().manual_seed(settings.seed)).tolist()
    heldout, train = order[:num_heldout], order[num_heldout:]
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
    accuracy, num_scored = evaluate_eagle3_draft(
        draft, [sequences[i] for i in heldout], [features[i] for i in heldout], embed_weight
    )
    return TrainedEagle3(
        draft,
        num_sequences=len(train),
        num_positions=sum(len(sequences[i]) - 1 for i in train),
        heldout_top1_accuracy=accuracy,
        num_heldout_positions=num_scored,
    )


def _training_sequences(
    llm: LLM,
    prompts: list[list[int]],
    settings: Eagle3Training,
    layer_ids: tuple[int, ...],
    work: Path,
    progress: Progress,
) -> tuple[list[list[int]], list[torch.Tensor]]:
    """The greedy sequences of three tokens or more, and their layers' features, shard by shard."""

    def make(shard_prompts: list[list[int]]) -> dict[str, torch.Tensor]:
        sequences = [s for s in greedy_sequences(llm, shard_prompts, settings.max_new_tokens) if len(s) >= 3]
        width = len(layer_ids) * llm.engine.runner.shape.hidden_size
        return {
            "token_ids": torch.tensor([t for s in sequences for t in s], dtype=torch.int64),
            "lengths": torch.tensor([len(s) for s in sequences], dtype=torch.int64),
            "features": torch.cat([layer_features(llm, s, layer_ids) for s in sequences])
            if sequences
            else torch.empty(0, width),
        }

    sequences: list[list[int]] = []
    features: list[torch.Tensor] = []
    for _, shard in cached_shards(work, "eagle3-data", prompts, settings.prompts_per_shard, make, progress):
        lengths = shard["lengths"].tolist()
        sequences += [chunk.tolist() for chunk in shard["token_ids"].split(lengths)]
        features += list(shard["features"].split(lengths))
    return sequences, features


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
    layer_config = LlamaConfig(
        **{
            key: value
            for key, value in target_config.to_dict().items()
            if key not in ("architectures", "model_type", "num_hidden_layers")
        },
        num_hidden_layers=1,
    )
    shape = EagleDraftShape.from_layer_config(layer_config, 1, False, False, own_embedding=False, own_lm_head=True)
    eagle3 = Eagle3Shape(len(vocabulary), shape.hidden_size, layer_ids, norm_before_residual=False)
    generator = torch.Generator().manual_seed(seed)
    draft = Eagle3Draft(shape, eagle3, max_positions, layer_config, torch.float32)
    with torch.no_grad():
        for name, parameter in draft.named_parameters():
            if parameter.dim() >= 2:
                parameter.normal_(0.0, parameter.shape[1] ** -0.5, generator=generator)
            elif not name.endswith("norm.weight"):
                parameter.zero_()
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
    ``embed_weight``, for ``settings.num_steps`` steps in all: resumed from ``state_path`` and
    saved there every ``checkpoint_every`` steps, if given. Returns the last step's loss."""
    usable = [i for i, sequence in enumerate(sequences) if len(sequence) >= 3]
    if not usable:
        raise ValueError("EAGLE-3 training needs sequences of three tokens or more")
    to_draft = _to_draft(draft, embed_weight.shape[0])
    optimizer = torch.optim.AdamW(draft.parameters(), lr=settings.learning_rate, weight_decay=0.0)
    sampler = torch.Generator().manual_seed(settings.seed)
    start = resume_training(state_path, "draft", draft, optimizer, sampler) if state_path is not None else 0
    draft.train()
    loss = torch.zeros(())
    for step in progress(range(start, settings.num_steps), "training", settings.num_steps - start):
        picks = torch.randint(len(usable), (settings.sequences_per_step,), generator=sampler).tolist()
        loss = torch.stack(
            [_loss(draft, sequences[usable[p]], features[usable[p]], embed_weight, to_draft) for p in picks]
        ).mean()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        done = step + 1
        if state_path is not None and (done % settings.checkpoint_every == 0 or done == settings.num_steps):
            save_training(state_path, "draft", done, draft, optimizer, sampler)
    draft.eval()
    return float(loss.detach())


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
    outputs = draft(
        F.embedding(token_ids[1:], embed_weight),
        draft.fuse(features[:num_entries]),
        torch.arange(num_entries),
        [new_draft_kv(draft, 0, num_entries)],
        [num_entries],
    )
    loss = _token_loss(draft.logits(outputs[:-1]), to_draft[token_ids[2:]])
    if num_entries >= 3:
        # As a chain runs: entry i + 1 reads token i + 2 with the draft's own output at i.
        unrolled = draft(
            F.embedding(token_ids[2:], embed_weight),
            outputs[:-1],
            torch.arange(1, num_entries),
            [new_draft_kv(draft, 1, num_entries - 1)],
            [num_entries - 1],
        )
        loss = loss + _token_loss(draft.logits(unrolled[:-1]), to_draft[token_ids[3:]])
    return loss


def _token_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy over the targets the draft can name (0 when it can name none)."""
    total = F.cross_entropy(logits, targets, ignore_index=_IGNORED, reduction="sum")
    return total / (targets != _IGNORED).sum().clamp(min=1)


@torch.no_grad()
def evaluate_eagle3_draft(
    draft: Eagle3Draft, sequences: list[list[int]], features: list[torch.Tensor], embed_weight: torch.Tensor
) -> tuple[float, int]:
    """The first draft's top-1 accuracy over ``sequences`` (as target ids, every entry with a token
    two ahead), and how many entries were scored."""
    num_right = num_scored = 0
    for sequence, sequence_features in zip(sequences, features):
        if len(sequence) < 3:
            continue
        token_ids = torch.tensor(sequence)
        num_entries = len(sequence) - 1
        outputs = draft(
            F.embedding(token_ids[1:], embed_weight),
            draft.fuse(sequence_features[:num_entries]),
            torch.arange(num_entries),
            [new_draft_kv(draft, 0, num_entries)],
            [num_entries],
        )
        guesses = draft.draft_token_ids(outputs[:-1], lambda x: x)
        num_right += int((guesses == token_ids[2:]).sum())
        num_scored += len(sequence) - 2
    return (num_right / num_scored if num_scored else 0.0), num_scored
