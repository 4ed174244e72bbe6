"""Medusa heads on disk: the layouts published heads come in, read from safetensors only.

- **Medusa-1** (FasterDecoding/Medusa, and Hugging Face TGI, which reads the same files):
  ``config.json`` with ``medusa_num_heads`` and ``medusa_num_layers`` (often beside a copy of
  the base model's config); ``medusa_lm_head.safetensors`` holding, per head ``i``, its residual
  blocks ``{i}.{j}.linear.weight`` / ``.bias`` and its vocabulary projection ``{i}.{L}.weight``
  (``L`` = the number of layers), sometimes under a ``medusa_head.`` prefix.
- **vLLM's** (``vllm/model_executor/models/medusa.py``): ``config.json`` with ``num_heads``,
  ``num_hidden_layers``, ``hidden_size``, ``vocab_size``, and optionally ``medusa_fc_bias``,
  ``original_lm_head`` (one projection, ``lm_heads.0.weight``, shared by every head) and
  ``truncated_vocab_size`` (the heads predict over that many tokens, mapped to the target's ids
  by a ``token_map`` tensor); weights ``blocks.{i}.layers.{j}.weight`` / ``.bias`` and
  ``lm_heads.{i}.weight`` in any ``*.safetensors`` of the folder, sometimes under
  ``medusa_heads.``.

A vLLM-layout folder with ``original_lm_head`` and no ``lm_heads`` tensor at all uses the
target's own LM head: what ``splitserve train-heads`` writes (engine/spec_decode/medusa_training.py),
so that its heads weigh a few residual blocks, not a vocabulary projection each. vLLM cannot
read such a folder as it stands (it expects the projection in the file).

A pickle (``.bin``, ``.pt``) is never loaded: unpickling a downloaded file can run any code.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
from safetensors.torch import load_file, save_file

from engine.spec_decode.medusa import MedusaHeads

MEDUSA_1_WEIGHTS = "medusa_lm_head.safetensors"
_PREFIXES = ("medusa_heads.", "medusa_head.")
_MEDUSA_1_BLOCK = re.compile(r"^(\d+)\.(\d+)\.linear\.(weight|bias)$")
_MEDUSA_1_PROJECTION = re.compile(r"^(\d+)\.(\d+)\.weight$")


@dataclass(frozen=True, slots=True)
class MedusaCheckpointConfig:
    layout: Literal["medusa-1", "vllm"]
    num_heads: int
    num_layers: int
    hidden_size: int | None  # None: not stated (Medusa-1 configs may leave it to the base model)
    vocab_size: int | None
    truncated_vocab_size: int | None  # the heads' own vocabulary, mapped by token_map
    shared_lm_head: bool  # vLLM's original_lm_head: one projection for every head


def read_medusa_config(folder: Path) -> MedusaCheckpointConfig:
    """The heads' shape from ``folder/config.json``; ValueError, saying what is missing, for a
    folder that is not Medusa heads."""
    config_path = folder.expanduser() / "config.json"
    if not config_path.is_file():
        raise ValueError(f"Medusa heads: {folder} has no config.json; give the folder of a Medusa checkpoint")
    config = json.loads(config_path.read_text())
    if "medusa_num_heads" in config:
        layout: Literal["medusa-1", "vllm"] = "medusa-1"
        num_heads, num_layers = config["medusa_num_heads"], config.get("medusa_num_layers", 1)
    elif "num_heads" in config:
        layout = "vllm"
        num_heads, num_layers = config["num_heads"], config.get("num_hidden_layers", 1)
    else:
        raise ValueError(
            f"{config_path} names no Medusa heads (medusa_num_heads, or vLLM's num_heads); is {folder} a Medusa "
            "checkpoint?"
        )
    vocab_size = config.get("vocab_size")
    truncated = config.get("truncated_vocab_size")
    return MedusaCheckpointConfig(
        layout=layout,
        num_heads=int(num_heads),
        num_layers=int(num_layers),
        hidden_size=config.get("hidden_size"),
        vocab_size=vocab_size,
        truncated_vocab_size=truncated if truncated is not None and truncated != vocab_size else None,
        shared_lm_head=bool(config.get("original_lm_head", False)),
    )


def load_medusa_heads(
    folder: Path, hidden_size: int, vocab_size: int, dtype: torch.dtype, device: torch.device
) -> MedusaHeads:
    """The heads in ``folder`` for a target of ``hidden_size`` and ``vocab_size``, in ``dtype``
    on ``device``. ValueError for a pickle, a shape that does not fit the target, or a tensor
    missing or left over."""
    folder = folder.expanduser()
    config = read_medusa_config(folder)
    if config.hidden_size is not None and config.hidden_size != hidden_size:
        raise ValueError(
            f"the Medusa heads in {folder} read hidden states of {config.hidden_size}, the target's are "
            f"{hidden_size}: they were trained for another model"
        )
    if config.vocab_size is not None and config.vocab_size != vocab_size:
        raise ValueError(
            f"the Medusa heads in {folder} predict a vocabulary of {config.vocab_size} tokens, the target's has "
            f"{vocab_size}: they were trained for another model"
        )
    weights = _renamed(_read_weights(folder, config), config)
    num_lm_heads = len({name for name in weights if name.startswith("lm_heads.")})
    if not config.shared_lm_head and num_lm_heads not in (0, config.num_heads):
        raise ValueError(
            f"the Medusa heads in {folder} hold vocabulary projections for {num_lm_heads} heads, their config says "
            f"{config.num_heads}"
        )
    heads = MedusaHeads(
        num_heads=config.num_heads,
        num_layers=config.num_layers,
        hidden_size=hidden_size,
        bias="blocks.0.layers.0.bias" in weights,
        num_lm_heads=1 if config.shared_lm_head and num_lm_heads else num_lm_heads,
        head_vocab_size=config.truncated_vocab_size or vocab_size,
    )
    token_map = weights.pop("token_map", None)
    if config.truncated_vocab_size is not None:
        if token_map is None:
            raise ValueError(
                f"the Medusa heads in {folder} predict {config.truncated_vocab_size} of the target's {vocab_size} "
                "tokens but hold no token_map to say which"
            )
        heads.token_map = token_map.to(device=device, dtype=torch.int64)
    if config.shared_lm_head:
        # vLLM's original_lm_head: the one projection is lm_heads.0; any others are unused copies.
        weights = {
            name: w for name, w in weights.items() if not name.startswith("lm_heads.") or name.startswith("lm_heads.0.")
        }
    missing, unexpected = heads.load_state_dict(weights, strict=False)
    if missing or unexpected:
        raise ValueError(
            f"the Medusa heads in {folder} do not match their config ({config.num_heads} heads of "
            f"{config.num_layers} layers): missing {missing[:4]}, unexpected {unexpected[:4]}"
        )
    return heads.to(device=device, dtype=dtype).eval()


def save_medusa_heads(heads: MedusaHeads, folder: Path, vocab_size: int, extra: dict[str, object]) -> None:
    """Write ``heads`` in vLLM's layout (``config.json``, ``model.safetensors``); heads without a
    projection of their own are marked ``original_lm_head`` (the target's LM head). ``extra``:
    more config keys (what the heads were trained for and on)."""
    folder.mkdir(parents=True, exist_ok=True)
    hidden_size = heads.blocks[0].layers[0].in_features if heads.blocks[0].layers else None
    config = {
        "architectures": ["MedusaModel"],
        "model_type": "medusa",
        "num_heads": heads.num_heads,
        "num_hidden_layers": len(heads.blocks[0].layers),
        "hidden_size": hidden_size,
        "vocab_size": vocab_size,
        "medusa_fc_bias": heads.blocks[0].layers[0].bias is not None if heads.blocks[0].layers else False,
        "original_lm_head": len(heads.lm_heads) <= 1,
        **extra,
    }
    tensors = {name: tensor.detach().contiguous().cpu() for name, tensor in heads.state_dict().items()}
    save_file(tensors, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")


def _read_weights(folder: Path, config: MedusaCheckpointConfig) -> dict[str, torch.Tensor]:
    files = [folder / MEDUSA_1_WEIGHTS] if config.layout == "medusa-1" else sorted(folder.glob("*.safetensors"))
    present = [path for path in files if path.is_file()]
    if present:
        weights: dict[str, torch.Tensor] = {}
        for path in present:
            weights.update(load_file(str(path)))
        return weights
    refuse_pickles(folder, "Medusa heads", MEDUSA_1_WEIGHTS if config.layout == "medusa-1" else "model.safetensors")
    expected = MEDUSA_1_WEIGHTS if config.layout == "medusa-1" else "*.safetensors"
    raise ValueError(f"the Medusa heads in {folder} have no weights: expected {expected}")


def refuse_pickles(folder: Path, what: str, safetensors_name: str) -> None:
    """ValueError naming the offline conversion when ``folder`` holds its weights as a pickle
    only (called once no safetensors file was found); ``what``: the checkpoint, for the message."""
    pickles = sorted(p.name for pattern in ("*.bin", "*.pt", "*.pth") for p in folder.glob(pattern))
    if pickles:
        name = pickles[0]
        raise ValueError(
            f"the {what} in {folder} are a pickle ({name}), which is never loaded here: unpickling a downloaded "
            "file can run any code. Convert it once, offline, where you trust the file, with torch's weights-only "
            'loader: python -c "import torch; from safetensors.torch import save_file; '
            f"save_file(torch.load('{name}', weights_only=True, map_location='cpu'), '{safetensors_name}')\""
        )


def _renamed(weights: dict[str, torch.Tensor], config: MedusaCheckpointConfig) -> dict[str, torch.Tensor]:
    """Checkpoint tensor names -> :class:`MedusaHeads`'s (vLLM's)."""
    renamed: dict[str, torch.Tensor] = {}
    for name, tensor in weights.items():
        for prefix in _PREFIXES:
            name = name.removeprefix(prefix)
        if config.layout == "medusa-1":
            if block := _MEDUSA_1_BLOCK.match(name):
                head, layer, kind = block.groups()
                name = f"blocks.{head}.layers.{layer}.{kind}"
            elif (projection := _MEDUSA_1_PROJECTION.match(name)) and int(projection[2]) == config.num_layers:
                name = f"lm_heads.{projection[1]}.weight"
        renamed[name] = tensor
    return renamed
