"""Random Medusa heads for the tiny checkpoints (tests.checkpoints), written in each layout the
loader reads (engine/spec_decode/medusa_checkpoint.py)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Literal

import torch
from safetensors.torch import save_file

from engine.spec_decode.medusa import MedusaHeads
from engine.spec_decode.medusa_checkpoint import save_medusa_heads
from tests.checkpoints import VOCAB_SIZE

HIDDEN_SIZE = 64  # tests.checkpoints' models


def random_heads(num_heads: int, num_layers: int, own_projections: bool, seed: int = 0) -> MedusaHeads:
    torch.manual_seed(seed)
    heads = MedusaHeads(num_heads, num_layers, HIDDEN_SIZE, True, num_heads if own_projections else 0, VOCAB_SIZE)
    with torch.no_grad():
        for param in heads.parameters():
            param.normal_(0.0, 0.25)
    return heads


def make_medusa_heads(
    directory: Path,
    layout: Literal["medusa-1", "vllm"],
    num_heads: int = 3,
    num_layers: int = 1,
    own_projections: bool = True,
    seed: int = 0,
) -> Path:
    """Random heads in ``layout``: Medusa-1's ``medusa_lm_head.safetensors`` (a projection per
    head, as FasterDecoding/Medusa saves them), or vLLM's (``own_projections`` False: the
    target's LM head)."""
    heads = random_heads(num_heads, num_layers, own_projections or layout == "medusa-1", seed)
    directory.mkdir(parents=True, exist_ok=True)
    if layout == "vllm":
        save_medusa_heads(heads, directory, VOCAB_SIZE, {})
        return directory
    tensors = {}
    for head in range(num_heads):
        for layer in range(num_layers):
            linear = heads.blocks[head].layers[layer]
            tensors[f"{head}.{layer}.linear.weight"] = linear.weight.detach().clone()
            tensors[f"{head}.{layer}.linear.bias"] = linear.bias.detach().clone()
        tensors[f"{head}.{num_layers}.weight"] = heads.lm_heads[head].weight.detach().clone()
    save_file(tensors, str(directory / "medusa_lm_head.safetensors"))
    config = {"medusa_num_heads": num_heads, "medusa_num_layers": num_layers, "base_model_name_or_path": "tiny"}
    (directory / "config.json").write_text(json.dumps(config))
    return directory


def make_cycling_checkpoint(
    directory: Path, cycle_length: int = 24, num_steps: int = 40, **overrides: object
) -> tuple[Path, list[int]]:
    """The tiny checkpoint (``overrides`` of its config, if any) taught (a few dozen steps of
    transformers' own training) to continue a fixed cycle of ``cycle_length`` tokens: a target
    whose greedy continuations follow a pattern heads can learn, where a random checkpoint's are
    noise. Returns the folder and the cycle."""
    import random

    from transformers import AutoModelForCausalLM

    from tests.checkpoints import make_checkpoint

    make_checkpoint(directory, **overrides)
    cycle = random.Random(0).sample(range(3, VOCAB_SIZE), cycle_length)
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    generator = torch.Generator().manual_seed(0)
    model.train()
    for _ in range(num_steps):
        starts = torch.randint(0, cycle_length, (8,), generator=generator).tolist()
        batch = torch.tensor([cycle_snippet(cycle, start, 32) for start in starts])
        loss = model(batch, labels=batch).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.save_pretrained(directory)
    return directory, cycle


def cycle_snippet(cycle: list[int], start: int, length: int) -> list[int]:
    return [cycle[(start + j) % len(cycle)] for j in range(length)]
