"""What EAGLE's and EAGLE-3's self-distillation share (eagle_training.py, eagle3_training.py).

Both train a draft of :class:`~engine.spec_decode.eagle_draft.DraftNetwork`'s kind on the target's
own greedy continuations and the target's features along them (each method its own features and
loss), in the same steps:

1. :func:`training_sequences`: the continuations of three tokens or more and their features, in
   shards saved as Medusa training saves its own (engine/spec_decode/medusa_training.py), so an
   interrupted run makes no shard twice.
2. :func:`split_heldout`: a fraction of the sequences held out for scoring.
3. :func:`new_layer_config`, :func:`init_draft_weights`: a draft shaped like the target's layers,
   small random weights.
4. :func:`train_steps`: AdamW over random picks of sequences, the state saved every
   ``checkpoint_every`` steps and resumed from there.
5. :func:`scored`: the first draft's held-out top-1 accuracy (:func:`first_draft_accuracy`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Generic, TypeVar

import torch
import torch.nn.functional as F
from torch import nn
from transformers import LlamaConfig, PretrainedConfig

from engine.llm import LLM
from engine.spec_decode.eagle_draft import DraftEntries, DraftNetwork, new_draft_kv
from engine.spec_decode.medusa_training import (
    Progress,
    cached_shards,
    greedy_sequences,
    no_progress,
    resume_training,
    save_training,
    shard_recipe,
)


@dataclass(slots=True)
class SelfDistillation:
    """The data and the loop of a draft's training (each method adds its own settings)."""

    max_new_tokens: int = 128  # each prompt's greedy continuation
    # About 12 passes over the shipped prompts: a third as many steps left the first draft right
    # on fewer held-out positions (docs/benchmarks.md, "Drafts trained on more questions").
    num_steps: int = 1500
    sequences_per_step: int = 4
    learning_rate: float = 3e-3
    heldout_fraction: float = 0.05
    prompts_per_shard: int = 16
    checkpoint_every: int = 50
    seed: int = 0


DraftT = TypeVar("DraftT", bound=DraftNetwork)


@dataclass(slots=True)
class TrainedDraft(Generic[DraftT]):
    draft: DraftT
    num_sequences: int
    num_positions: int  # entries trained on
    heldout_top1_accuracy: float  # the first draft's, on sequences never trained on
    num_heldout_positions: int


LMHead = Callable[[torch.Tensor], torch.Tensor]


def training_sequences(
    llm: LLM,
    prompts: list[list[int]],
    settings: SelfDistillation,
    shard_name: str,
    features_of: Callable[[list[int]], torch.Tensor],
    feature_width: int,
    work: Path,
    progress: Progress = no_progress,
) -> tuple[list[list[int]], list[torch.Tensor]]:
    """The greedy sequences of three tokens or more, and their features (``features_of`` one
    sequence: [len, feature_width]), shard by shard under ``work/shard_name``."""

    def make(shard_prompts: list[list[int]]) -> dict[str, torch.Tensor]:
        sequences = [s for s in greedy_sequences(llm, shard_prompts, settings.max_new_tokens) if len(s) >= 3]
        return {
            "token_ids": torch.tensor([t for s in sequences for t in s], dtype=torch.int64),
            "lengths": torch.tensor([len(s) for s in sequences], dtype=torch.int64),
            "features": torch.cat([features_of(s) for s in sequences]) if sequences else torch.empty(0, feature_width),
        }

    sequences: list[list[int]] = []
    features: list[torch.Tensor] = []
    recipe = shard_recipe(llm, settings.max_new_tokens)
    for _, shard in cached_shards(work, shard_name, recipe, prompts, settings.prompts_per_shard, make, progress):
        lengths = shard["lengths"].tolist()
        sequences += [chunk.tolist() for chunk in shard["token_ids"].split(lengths)]
        features += list(shard["features"].split(lengths))
    return sequences, features


def split_heldout(num_sequences: int, settings: SelfDistillation, method: str) -> tuple[list[int], list[int]]:
    """The indices of the held-out sequences and of those trained on, drawn by ``settings.seed``;
    ValueError (naming ``method``) when there are too few sequences to hold one out."""
    if num_sequences < 2:
        raise ValueError(f"{method} training needs at least two prompts whose continuations reach three tokens")
    num_heldout = min(num_sequences - 1, max(1, round(num_sequences * settings.heldout_fraction)))
    order = torch.randperm(num_sequences, generator=torch.Generator().manual_seed(settings.seed)).tolist()
    return order[:num_heldout], order[num_heldout:]


def served_embedding_weight(llm: LLM) -> torch.Tensor:
    """The target's embedding as served, [vocab, hidden_size] float32 (the module applied to
    every token id, whatever its storage)."""
    runner = llm.engine.runner
    with torch.inference_mode():
        rows = runner.model.embed_tokens(torch.arange(runner.shape.vocab_size, device=runner.device)).float()
    return rows.clone().cpu()  # a plain tensor (not an inference one): autograd may save it


def new_layer_config(target_config: PretrainedConfig, num_layers: int) -> LlamaConfig:
    """The draft's layers' config: the target's numbers, ``num_layers`` of them."""
    return LlamaConfig(
        **{
            key: value
            for key, value in target_config.to_dict().items()
            if key not in ("architectures", "model_type", "num_hidden_layers")
        },
        num_hidden_layers=num_layers,
    )


def init_draft_weights(draft: nn.Module, seed: int) -> None:
    """Matrices drawn with a standard deviation of ``fan_in ** -0.5``, biases zero, norms one."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in draft.named_parameters():
            if parameter.dim() >= 2:
                parameter.normal_(0.0, parameter.shape[1] ** -0.5, generator=generator)
            elif not name.endswith("norm.weight"):
                parameter.zero_()


def train_steps(
    draft: nn.Module,
    sequences: list[list[int]],
    loss_of: Callable[[int], torch.Tensor],
    settings: SelfDistillation,
    method: str,
    state_path: Path | None = None,
    progress: Progress = no_progress,
) -> float:
    """Train ``draft`` in place on ``settings.sequences_per_step`` random picks of ``sequences``
    a step (``loss_of`` a sequence's index: its loss), for ``settings.num_steps`` steps in all:
    resumed from ``state_path`` and saved there every ``checkpoint_every`` steps, if given.
    Returns the last step's loss (0 when no step was left)."""
    usable = [i for i, sequence in enumerate(sequences) if len(sequence) >= 3]
    if not usable:
        raise ValueError(f"{method} training needs sequences of three tokens or more")
    optimizer = torch.optim.AdamW(draft.parameters(), lr=settings.learning_rate, weight_decay=0.0)
    sampler = torch.Generator().manual_seed(settings.seed)
    start = resume_training(state_path, "draft", draft, optimizer, sampler) if state_path is not None else 0
    draft.train()
    loss = torch.zeros(())
    for step in progress(range(start, settings.num_steps), "training", settings.num_steps - start):
        picks = torch.randint(len(usable), (settings.sequences_per_step,), generator=sampler).tolist()
        loss = torch.stack([loss_of(usable[p]) for p in picks]).mean()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        done = step + 1
        if state_path is not None and (done % settings.checkpoint_every == 0 or done == settings.num_steps):
            save_training(state_path, "draft", done, draft, optimizer, sampler)
    draft.eval()
    return float(loss.detach())


def entry_outputs(
    draft: DraftNetwork, sequence: list[int], features: torch.Tensor, embed_weight: torch.Tensor
) -> torch.Tensor:
    """Entries 0 .. L-2 of one sequence (token ``i + 1`` with the target's feature at ``i``) in one
    pass, as serving makes them; their outputs [L - 1, hidden_size]."""
    num_entries = len(sequence) - 1
    return run_entries(draft, torch.tensor(sequence[1:]), draft.fuse(features[:num_entries]), embed_weight, 0)


def run_entries(
    draft: DraftNetwork, token_ids: torch.Tensor, hidden: torch.Tensor, embed_weight: torch.Tensor, start: int
) -> torch.Tensor:
    """Entries ``start ..`` of a fresh draft KV in one pass, entry ``start + e`` reading token
    ``token_ids[e]`` with ``hidden[e]`` (a fused feature, or the draft's own output); their
    outputs [len(token_ids), hidden_size]."""
    entries = DraftEntries.after(new_draft_kv(draft, start, token_ids.shape[0]), token_ids.shape[0])
    return draft(F.embedding(token_ids, embed_weight), hidden, entries)


@torch.no_grad()
def first_draft_accuracy(
    draft: DraftNetwork,
    sequences: list[list[int]],
    features: list[torch.Tensor],
    embed_weight: torch.Tensor,
    target_lm_head: LMHead,
) -> tuple[float, int]:
    """The first draft's top-1 accuracy over ``sequences`` (as target ids, every entry with a
    token two ahead), and how many entries were scored."""
    num_right = num_scored = 0
    for sequence, sequence_features in zip(sequences, features):
        if len(sequence) < 3:
            continue
        outputs = entry_outputs(draft, sequence, sequence_features, embed_weight)[:-1]
        guesses = draft.draft_token_ids(outputs, target_lm_head)
        num_right += int((guesses == torch.tensor(sequence[2:])).sum())
        num_scored += len(sequence) - 2
    return (num_right / num_scored if num_scored else 0.0), num_scored


def scored(
    draft: DraftT,
    sequences: list[list[int]],
    features: list[torch.Tensor],
    train: list[int],
    heldout: list[int],
    embed_weight: torch.Tensor,
    target_lm_head: LMHead,
) -> TrainedDraft[DraftT]:
    """The trained ``draft`` with what it was trained on and its held-out accuracy."""
    accuracy, num_scored = first_draft_accuracy(
        draft, [sequences[i] for i in heldout], [features[i] for i in heldout], embed_weight, target_lm_head
    )
    return TrainedDraft(
        draft,
        num_sequences=len(train),
        num_positions=sum(len(sequences[i]) - 1 for i in train),
        heldout_top1_accuracy=accuracy,
        num_heldout_positions=num_scored,
    )
