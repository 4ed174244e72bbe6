"""EAGLE-3 drafts for the tiny checkpoints (tests.checkpoints): random ones written in each layout
the loader reads (engine/spec_decode/eagle3_checkpoint.py), and one trained on a cycling target
over a draft vocabulary smaller than the target's, so that its drafts agree with the target where
a random one's do not, and only through its d2t map."""

from __future__ import annotations

import json
import random
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM

from engine.spec_decode.eagle3_checkpoint import save_eagle3_draft
from engine.spec_decode.eagle3_draft import Eagle3Draft, Eagle3Shape
from engine.spec_decode.eagle_checkpoint import EagleLayout
from engine.spec_decode.eagle_draft import EagleDraftShape, new_draft_kv
from tests.checkpoints import VOCAB_SIZE, tiny_config
from tests.engine.spec_decode.medusa_heads import HIDDEN_SIZE, cycle_snippet, make_cycling_checkpoint

MAX_POSITIONS = 1024  # tests.checkpoints' models
# A target deep enough for EAGLE-3's default layers (2, L // 2, L - 3) to be three distinct ones.
NUM_TARGET_LAYERS = 8
DEFAULT_LAYER_IDS = (2, 4, 5)


def draft_vocabulary(size: int, seed: int, keep: list[int] = []) -> list[int]:  # noqa: B006 (never mutated)
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
    on its greedy continuations, drafting in a vocabulary of 64 tokens that holds the cycle: one
    in the speculators layout, and the same draft with its d2t zeroed (its draft ids taken as the
    target's). Returns the target's folder, its cycle, the trained draft's and the unmapped one's."""
    target, cycle = make_cycling_checkpoint(directory / "target", num_hidden_layers=4)
    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    sequences = []
    with torch.no_grad():
        for start in range(0, len(cycle), 2):
            prompt = torch.tensor([cycle_snippet(cycle, start, 6)])
            sequences.append(model.generate(prompt, max_new_tokens=40, do_sample=False, pad_token_id=0)[0])
        # The residual stream entering layer i is transformers' hidden_states[i].
        features = [
            torch.cat([model(s[None], output_hidden_states=True).hidden_states[i][0] for i in CYCLE_LAYER_IDS], -1)
            for s in sequences
        ]
    vocabulary = draft_vocabulary(64, seed=1, keep=cycle)
    to_draft = torch.full((VOCAB_SIZE,), -100)  # ignored by the loss: tokens the draft cannot name
    to_draft[torch.tensor(vocabulary)] = torch.arange(len(vocabulary))
    embed = model.get_input_embeddings().weight.detach()
    draft = random_eagle3_draft(seed=2, vocabulary=vocabulary, feature_layer_ids=CYCLE_LAYER_IDS)
    optimizer = torch.optim.AdamW(draft.parameters(), lr=3e-3)
    generator = torch.Generator().manual_seed(0)
    draft.train()
    for _ in range(num_steps):
        losses = []
        for pick in torch.randint(len(sequences), (4,), generator=generator).tolist():
            tokens, num_entries = sequences[pick], len(sequences[pick]) - 1
            # Entry i reads token i + 1 and the target's layers at i, and guesses token i + 2.
            outputs = draft(
                F.embedding(tokens[1:], embed),
                draft.fuse(features[pick][:num_entries]),
                torch.arange(num_entries),
                [new_draft_kv(draft, 0, num_entries)],
                [num_entries],
            )
            losses.append(F.cross_entropy(draft.logits(outputs[:-1]), to_draft[tokens[2:]], ignore_index=-100))
        loss = torch.stack(losses).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    draft.eval()
    trained, unmapped = directory / "trained", directory / "unmapped"
    save_eagle3_draft(draft, trained, "speculators", {})
    with torch.no_grad():
        draft.d2t.zero_()
    save_eagle3_draft(draft, unmapped, "speculators", {})
    return target, cycle, trained, unmapped
