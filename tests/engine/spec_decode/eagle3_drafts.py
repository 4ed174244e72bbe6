"""EAGLE-3 drafts for the tiny checkpoints (tests.checkpoints): random ones written in each layout
the loader reads (engine/spec_decode/eagle3_checkpoint.py), and one trained on a cycling target
over a draft vocabulary smaller than the target's, so that its drafts agree with the target where
a random one's do not, and only through its d2t map."""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from pathlib import Path

import torch

from engine.llm import LLM
from engine.spec_decode.draft_training import served_embedding_weight
from engine.spec_decode.eagle3_checkpoint import save_eagle3_draft
from engine.spec_decode.eagle3_draft import Eagle3Draft, Eagle3Shape
from engine.spec_decode.eagle3_training import Eagle3Training, layer_features, new_eagle3_draft, train_eagle3_draft
from engine.spec_decode.eagle_checkpoint import EagleLayout
from engine.spec_decode.eagle_draft import EagleDraftShape
from engine.spec_decode.medusa_training import greedy_sequences
from tests.checkpoints import VOCAB_SIZE, tiny_config
from tests.engine.spec_decode.medusa_heads import HIDDEN_SIZE, cycle_snippet, make_cycling_checkpoint

MAX_POSITIONS = 1024  # tests.checkpoints' models
# A target deep enough for EAGLE-3's default layers (2, L // 2, L - 3) to be three distinct ones.
NUM_TARGET_LAYERS = 8
DEFAULT_LAYER_IDS = (2, 4, 5)


def random_vocabulary(size: int, seed: int, keep: Sequence[int] = ()) -> list[int]:
    """``size`` target token ids, ``keep`` among them, ascending (as EAGLE-3's d2t maps them)."""
    others = [t for t in range(VOCAB_SIZE) if t not in keep]
    return sorted([*keep, *random.Random(seed).sample(others, size - len(keep))])


def random_eagle3_draft(
    seed: int = 0,
    vocabulary: list[int] | None = None,
    feature_layer_ids: tuple[int, ...] = DEFAULT_LAYER_IDS,
    norm_before_residual: bool = False,
    own_embedding: bool = False,
) -> Eagle3Draft:
    """A one-layer EAGLE-3 draft for tests.checkpoints' targets, drafting in ``vocabulary`` (target
    ids, ascending; None: the target's whole vocabulary), weights spread as the targets' are."""
    layer_config = tiny_config("LlamaForCausalLM", num_hidden_layers=1)
    shape = EagleDraftShape.from_layer_config(layer_config, 1, False, False, own_embedding, True)
    vocabulary = vocabulary if vocabulary is not None else list(range(VOCAB_SIZE))
    eagle3 = Eagle3Shape(len(vocabulary), HIDDEN_SIZE, feature_layer_ids, norm_before_residual)
    torch.manual_seed(seed)
    draft = Eagle3Draft(shape, eagle3, MAX_POSITIONS, layer_config, torch.float32)
    with torch.no_grad():
        for name, param in draft.named_parameters():
            if param.dim() >= 2:
                param.normal_(0.0, 0.25)
            else:
                param.normal_(1.0 if name.endswith("norm.weight") else 0.0, 0.1)
        draft.d2t.copy_(torch.tensor(vocabulary) - torch.arange(len(vocabulary)))
    return draft


def make_eagle3_draft(directory: Path, layout: EagleLayout, name_layers: bool = True, **options: object) -> Path:
    """A random draft (:func:`random_eagle3_draft`'s ``options``) in ``layout``; ``name_layers``
    False leaves the target layers out of its config (EAGLE-3's defaults then)."""
    save_eagle3_draft(random_eagle3_draft(**options), directory, layout, {})  # type: ignore[arg-type]
    if not name_layers:
        config_path = directory / "config.json"
        config = json.loads(config_path.read_text())
        del config["eagle_aux_hidden_state_layer_ids"]
        config_path.write_text(json.dumps(config))
    return directory


CYCLE_LAYER_IDS = (0, 2, 3)  # of the 4-layer cycling target (its defaults would not be distinct)


def make_cycle_eagle3_drafts(directory: Path, num_steps: int = 80) -> tuple[Path, list[int], Path, Path]:
    """A 4-layer cycling target (tests.engine.spec_decode.medusa_heads) and an EAGLE-3 draft trained
    on its greedy continuations (engine/spec_decode/eagle3_training.py), drafting in a vocabulary of
    64 tokens that holds the cycle: one in the speculators layout, and the same draft with its d2t
    zeroed (its draft ids taken as the target's). Returns the target's folder, its cycle, the
    trained draft's folder and the unmapped one's."""
    target, cycle = make_cycling_checkpoint(directory / "target", num_hidden_layers=4)
    llm = LLM(model=str(target), dtype="float32", kv_cache_memory=1 << 22)
    prompts = [cycle_snippet(cycle, start, 6) for start in range(0, len(cycle), 2)]
    sequences = greedy_sequences(llm, prompts, 40)
    features = [layer_features(llm, sequence, CYCLE_LAYER_IDS) for sequence in sequences]
    vocabulary = random_vocabulary(64, seed=1, keep=cycle)
    draft = new_eagle3_draft(llm.engine.runner.hf_config, vocabulary, CYCLE_LAYER_IDS, MAX_POSITIONS, seed=2)
    embed_weight = served_embedding_weight(llm)
    train_eagle3_draft(draft, sequences, features, embed_weight, Eagle3Training(num_steps=num_steps))
    llm.close()
    trained, unmapped = directory / "trained", directory / "unmapped"
    save_eagle3_draft(draft, trained, "speculators", {})
    with torch.no_grad():
        draft.d2t.zero_()
    save_eagle3_draft(draft, unmapped, "speculators", {})
    return target, cycle, trained, unmapped
