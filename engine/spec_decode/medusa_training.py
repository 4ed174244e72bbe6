"""Medusa heads for a checkpoint nobody publishes heads for, by self-distillation on this machine.

Nothing but the target itself teaches the heads: they learn to guess what the target will say,
so its own greedy continuations are the labels (Medusa's self-distillation, with hard labels).

1. **Data** (:func:`make_training_data`): the engine generates a greedy continuation of each
   prompt, then runs prompt + continuation through its own forward pass (engine/teacher_forcing.py:
   the weights as served, GGUF blocks included) and keeps the final hidden state ``h_i`` of each
   position from the prompt's last token on, with the tokens ``i + 2 .. i + 1 + K`` that head
   ``0 .. K-1`` must guess there. Prompts go in shards, each saved once done
   (``work/data-NNNNN.safetensors``), so an interrupted run generates only what is missing.
2. **Training** (:func:`train_heads`): residual blocks zero-initialised (each head starts as the
   target's own next-token guess, as Medusa initialises them), the target's LM head frozen and
   shared by every head (read off the served module, quantized or not), AdamW on random batches of
   positions; head ``k``'s cross-entropy weighted ``decay ** k``. The heads, the optimizer and the
   batch sampler's state are saved every ``checkpoint_every`` steps (``work/train_state.pt``,
   loaded back weights-only), so a rerun resumes exactly where the last one stopped.
3. **Held out**: a fraction of the positions is never trained on; each head's top-1 accuracy there
   and the mean accepted length it implies go into the heads' config.
"""

from __future__ import annotations

import hashlib
import logging
import math
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from engine.llm import LLM
from engine.sampling_params import SamplingParams
from engine.spec_decode.medusa import MedusaHeads
from engine.teacher_forcing import borrowed_block_rows, forward

logger = logging.getLogger(__name__)

IGNORE = -100  # a target past the end of its sequence (cross_entropy's ignore_index)
# A progress bar over an iterable, or the iterable itself (tqdm where the command has it).
Progress = Callable[[Iterable[int], str, int], Iterable[int]]


def no_progress(items: Iterable[int], description: str, total: int) -> Iterable[int]:
    return items


@dataclass(slots=True)
class HeadTraining:
    num_heads: int = 3
    num_layers: int = 1
    max_new_tokens: int = 128  # each prompt's greedy continuation
    prompts_per_shard: int = 16
    num_steps: int = 500
    batch_size: int = 256  # positions a step
    learning_rate: float = 1e-3
    head_loss_decay: float = 0.8  # head k's loss weighs decay ** k: nearer guesses matter more
    heldout_fraction: float = 0.05
    checkpoint_every: int = 50
    seed: int = 0


@dataclass(slots=True)
class TrainingData:
    hidden: torch.Tensor  # [N, hidden_size] float32: final hidden state of each position
    targets: torch.Tensor  # [N, num_heads] int64: the tokens heads 0..K-1 must guess there (IGNORE past the end)


@dataclass(slots=True)
class HeldOut:
    top1_accuracy: list[float]  # per head
    mean_accepted_drafts: float  # expected drafts accepted a step: sum over k of P(heads 0..k all right)
    num_positions: int


def make_training_data(
    llm: LLM, prompts: list[list[int]], settings: HeadTraining, work: Path, progress: Progress = no_progress
) -> TrainingData:
    """Greedy continuations of ``prompts`` and the hidden states along them, shard by shard;
    shards already in ``work`` are read back, not made again."""

    def make(shard_prompts: list[list[int]]) -> dict[str, torch.Tensor]:
        shard = _shard(llm, shard_prompts, settings)
        return {"hidden": shard.hidden, "targets": shard.targets}

    hidden, targets = [], []
    recipe = f"{shard_recipe(llm, settings.max_new_tokens)} num_heads={settings.num_heads}"
    for _, tensors in cached_shards(work, "data", recipe, prompts, settings.prompts_per_shard, make, progress):
        hidden.append(tensors["hidden"])
        targets.append(tensors["targets"])
    return TrainingData(torch.cat(hidden), torch.cat(targets))


def shard_recipe(llm: LLM, max_new_tokens: int) -> str:
    """What of the model and the generation shapes every method's shards (:func:`cached_shards`)."""
    return f"model={llm.engine.model_path} dtype={llm.engine.runner.dtype} max_new_tokens={max_new_tokens}"


def cached_shards(
    work: Path,
    prefix: str,
    recipe: str,
    prompts: list[list[int]],
    prompts_per_shard: int,
    make: Callable[[list[list[int]]], dict[str, torch.Tensor]],
    progress: Progress = no_progress,
) -> list[tuple[Path, dict[str, torch.Tensor]]]:
    """``make``'s tensors for each shard of ``prompts`` (``work/<prefix>-NNNNN-<key>.safetensors``),
    made once: a shard saved by an earlier run is read back. ``recipe``: what else shapes a
    shard (the model, its dtype, the settings ``make`` reads), in words; with the shard's prompts
    it keys the file, so a run over other prompts or settings never reads a stale shard."""
    from safetensors.torch import load_file, save_file

    work.mkdir(parents=True, exist_ok=True)
    shards = [prompts[i : i + prompts_per_shard] for i in range(0, len(prompts), prompts_per_shard)]
    loaded = []
    for index in progress(range(len(shards)), "generating", len(shards)):
        key = hashlib.sha256(repr((recipe, shards[index])).encode()).hexdigest()[:16]
        path = work / f"{prefix}-{index:05d}-{key}.safetensors"
        if not path.is_file():
            save_file(make(shards[index]), str(path.with_suffix(".tmp")))
            path.with_suffix(".tmp").rename(path)  # a shard is there whole or not at all
        loaded.append((path, load_file(str(path))))
    return loaded


def resume_training(
    state_path: Path, name: str, module: torch.nn.Module, optimizer: torch.optim.Optimizer, sampler: torch.Generator
) -> int:
    """Load the training state an earlier run saved at ``state_path`` (weights only) into
    ``module`` (saved as ``name``), ``optimizer`` and ``sampler``; returns the steps it had done
    (0 when there is none)."""
    if not state_path.is_file():
        return 0
    state = torch.load(state_path, weights_only=True)
    module.load_state_dict(state[name])
    optimizer.load_state_dict(state["optimizer"])
    sampler.set_state(state["sampler"])
    logger.info("resuming training at step %d (%s)", int(state["step"]), state_path)
    return int(state["step"])


def save_training(
    state_path: Path,
    name: str,
    step: int,
    module: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    sampler: torch.Generator,
) -> None:
    """What :func:`resume_training` reads back, written whole or not at all."""
    state = {"step": step, name: module.state_dict(), "optimizer": optimizer.state_dict()}
    torch.save({**state, "sampler": sampler.get_state()}, state_path.with_suffix(".tmp"))
    state_path.with_suffix(".tmp").rename(state_path)


def greedy_sequences(llm: LLM, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """Each prompt followed by the target's greedy continuation: what the drafters learn from."""
    outputs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=max_new_tokens))
    return [prompt + list(output.outputs[0].token_ids) for prompt, output in zip(prompts, outputs)]


def _shard(llm: LLM, prompts: list[list[int]], settings: HeadTraining) -> TrainingData:
    hidden, targets = [], []
    for prompt, sequence in zip(prompts, greedy_sequences(llm, prompts, settings.max_new_tokens)):
        # From the prompt's last token (its hidden state sampled the first output token) to the
        # last position whose first head has a token to guess.
        positions = np.arange(len(prompt) - 1, len(sequence) - 2)
        if positions.size == 0:
            continue
        hidden.append(final_hidden(llm, sequence, positions))
        rows = []
        for i in positions:
            row = sequence[i + 2 : i + 2 + settings.num_heads]
            rows.append(row + [IGNORE] * (settings.num_heads - len(row)))
        targets.append(torch.tensor(rows, dtype=torch.int64))
    return TrainingData(torch.cat(hidden), torch.cat(targets))


def final_hidden(llm: LLM, sequence: list[int], positions: np.ndarray) -> torch.Tensor:
    """The final hidden states [len(positions), hidden_size] of ``sequence`` at ``positions``."""
    engine = llm.engine
    runner = engine.runner
    out = torch.empty(len(positions), runner.shape.hidden_size, dtype=runner.dtype, device=runner.device)
    with borrowed_block_rows(engine, 1, len(sequence)) as block_rows:
        forward(engine, sequence, [len(sequence)], [0], block_rows, logits_indices=positions, final_hidden_out=out)
    return out.float().cpu()


def served_lm_head_weight(llm: LLM) -> torch.Tensor:
    """The target's LM head as served, [vocab, hidden_size] float32, whatever its storage (GGUF
    blocks, int8 rows, a tied embedding): the module applied to the identity."""
    runner = llm.engine.runner
    with torch.inference_mode():
        eye = torch.eye(runner.shape.hidden_size, dtype=runner.dtype, device=runner.device)
        columns = runner.model.lm_head(eye).float()  # [hidden, vocab]
    return columns.T.clone().cpu()  # a plain tensor (not an inference one): autograd may save it


def new_heads(settings: HeadTraining, hidden_size: int, vocab_size: int) -> MedusaHeads:
    """Heads that guess as the target does: zero residual blocks over the target's LM head."""
    heads = MedusaHeads(settings.num_heads, settings.num_layers, hidden_size, True, 0, vocab_size)
    for parameter in heads.parameters():
        torch.nn.init.zeros_(parameter)
    return heads


def train_heads(
    data: TrainingData,
    lm_head_weight: torch.Tensor,
    settings: HeadTraining,
    work: Path,
    progress: Progress = no_progress,
) -> tuple[MedusaHeads, HeldOut]:
    """Train (or resume training) heads on ``data`` for ``settings.num_steps`` steps in all."""
    num_positions = data.hidden.shape[0]
    order = torch.randperm(num_positions, generator=torch.Generator().manual_seed(settings.seed))
    num_heldout = min(num_positions - 1, max(1, int(num_positions * settings.heldout_fraction)))
    heldout, train = order[:num_heldout], order[num_heldout:]
    vocab_size, hidden_size = lm_head_weight.shape
    heads = new_heads(settings, hidden_size, vocab_size)
    optimizer = torch.optim.AdamW(heads.parameters(), lr=settings.learning_rate, weight_decay=0.0)
    sampler = torch.Generator().manual_seed(settings.seed + 1)
    work.mkdir(parents=True, exist_ok=True)
    state_path = work / "train_state.pt"
    start = resume_training(state_path, "heads", heads, optimizer, sampler)
    heads.train()
    for step in progress(range(start, settings.num_steps), "training", settings.num_steps - start):
        batch = train[torch.randint(len(train), (settings.batch_size,), generator=sampler)]
        loss = _loss(heads, data.hidden[batch], data.targets[batch], lm_head_weight, settings.head_loss_decay)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        done = step + 1
        if done % settings.checkpoint_every == 0 or done == settings.num_steps:
            save_training(state_path, "heads", done, heads, optimizer, sampler)
    heads.eval()
    return heads, evaluate(heads, TrainingData(data.hidden[heldout], data.targets[heldout]), lm_head_weight)


def _loss(
    heads: MedusaHeads, hidden: torch.Tensor, targets: torch.Tensor, lm_head_weight: torch.Tensor, decay: float
) -> torch.Tensor:
    logits = heads.hidden_states(hidden, heads.num_heads) @ lm_head_weight.T  # [K, B, vocab]
    losses = [
        torch.nn.functional.cross_entropy(logits[k], targets[:, k], ignore_index=IGNORE) * decay**k
        for k in range(heads.num_heads)
        if bool((targets[:, k] != IGNORE).any())
    ]
    return torch.stack(losses).sum()


@torch.no_grad()
def evaluate(heads: MedusaHeads, data: TrainingData, lm_head_weight: torch.Tensor) -> HeldOut:
    """Each head's top-1 accuracy on ``data`` and the accepted length a top-1 chain would get."""
    guesses = torch.cat([_guesses(heads, hidden, lm_head_weight) for hidden in _batches(data.hidden)], dim=1)
    valid = data.targets.T != IGNORE  # [K, N]
    right = (guesses == data.targets.T) & valid
    accuracy = [float(right[k].sum() / valid[k].sum()) if valid[k].any() else math.nan for k in range(len(right))]
    # A chain's draft k is accepted only if drafts 0..k all were (positions where all K are known).
    full = valid.all(0)
    chain = right[:, full].cumprod(0).float().mean(1) if bool(full.any()) else torch.zeros(len(right))
    return HeldOut(accuracy, float(chain.sum()), num_positions=int(data.hidden.shape[0]))


def _guesses(heads: MedusaHeads, hidden: torch.Tensor, lm_head_weight: torch.Tensor) -> torch.Tensor:
    return (heads.hidden_states(hidden, heads.num_heads) @ lm_head_weight.T).argmax(-1)  # [K, B]


def _batches(hidden: torch.Tensor, size: int = 1024) -> Iterator[torch.Tensor]:
    for start in range(0, hidden.shape[0], size):
        yield hidden[start : start + size]
