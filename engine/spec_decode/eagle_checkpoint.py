"""EAGLE drafts on disk: the two layouts published drafts come in, read from safetensors only.

- **EAGLE's reference repository** (SafeAILab/EAGLE, EAGLE-1 and EAGLE-2 drafts): ``config.json``
  is a Llama config of the draft's layer(s) (``num_hidden_layers`` usually 1, ``hidden_size``
  the target's); weights ``fc.weight`` (and ``fc.bias``, which EAGLE-1's drafts have),
  ``layers.{i}.self_attn.{q,k,v,o}_proj.weight``, ``layers.{i}.mlp.{gate,up,down}_proj.weight``,
  ``layers.{i}.post_attention_layernorm.weight`` (layer 0 has no input norm), often
  ``embed_tokens.weight`` (a copy of the target's), no LM head (the target's serves).
- **The ``speculators`` package's** (``"speculators_model_type": "eagle"``): ``config.json`` holds
  the layer's Llama config under ``transformer_layer_config``, plus ``fusion_bias`` (fc has a
  bias: HASS) and ``layernorms`` (the TTT variant's ``post_embedding_layernorm``,
  ``pre_lm_head_layernorm`` and layer 0's input norm); one layer, the same tensor names as
  above, usually with ``embed_tokens.weight`` and ``lm_head.weight`` of the draft's own.

A missing ``embed_tokens`` or ``lm_head`` is the target's. A pickle (``pytorch_model.bin``, the
reference repository's usual file) is never loaded: unpickling a downloaded file can run any
code; the error names the offline conversion.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import torch
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import LlamaConfig

from engine.spec_decode.eagle_draft import EagleDraft, EagleDraftShape
from engine.spec_decode.medusa_checkpoint import refuse_pickles

if TYPE_CHECKING:
    from engine.spec_decode.eagle3_draft import Eagle3Draft

logger = logging.getLogger(__name__)

EagleLayout = Literal["eagle", "speculators"]
_PREFIXES = ("model.",)


@dataclass(frozen=True, slots=True)
class EagleCheckpointConfig:
    layout: EagleLayout
    layer_config: LlamaConfig  # the draft layer's (rotary frequencies, shapes)
    num_layers: int
    fusion_bias: bool | None  # speculators says; the reference layout: whether fc.bias is in the file
    layernorms: bool


def read_eagle_config(folder: Path) -> EagleCheckpointConfig:
    """The draft's shape from ``folder/config.json``; ValueError, saying what is missing, for a
    folder that is not an EAGLE draft."""
    config_path = folder.expanduser() / "config.json"
    if not config_path.is_file():
        raise ValueError(f"EAGLE draft: {folder} has no config.json; give the folder of an EAGLE checkpoint")
    config: dict[str, Any] = json.loads(config_path.read_text())
    kind = config.get("speculators_model_type")
    if kind is not None:
        if kind == "eagle3":
            raise ValueError(f'{config_path} is an EAGLE-3 draft: serve it with "method": "eagle3"')
        if kind != "eagle":
            raise ValueError(
                f"{config_path} is a speculators {kind!r} model; EAGLE drafts are speculators_model_type 'eagle' "
                "(method eagle) or 'eagle3' (method eagle3)"
            )
        layer = config.get("transformer_layer_config")
        if not isinstance(layer, dict):
            raise ValueError(f"{config_path} (speculators eagle) has no transformer_layer_config")
        return EagleCheckpointConfig(
            layout="speculators",
            layer_config=llama_layer_config(layer, config_path),
            num_layers=1,  # speculators' EAGLE always has one layer, whatever its layer config says
            fusion_bias=bool(config.get("fusion_bias", False)),
            layernorms=bool(config.get("layernorms", False)),
        )
    if "hidden_size" not in config:
        raise ValueError(
            f"{config_path} is neither an EAGLE draft's Llama config (hidden_size, num_hidden_layers, ...) nor a "
            "speculators one (speculators_model_type); is {folder} an EAGLE checkpoint?"
        )
    if is_reference_eagle3(config):
        raise ValueError(f'{config_path} is an EAGLE-3 draft (draft_vocab_size): serve it with "method": "eagle3"')
    layer_config = llama_layer_config(config, config_path)
    return EagleCheckpointConfig(
        layout="eagle",
        layer_config=layer_config,
        num_layers=int(layer_config.num_hidden_layers),
        fusion_bias=None,
        layernorms=False,
    )


def load_eagle_draft(
    folder: Path, hidden_size: int, vocab_size: int, max_positions: int, dtype: torch.dtype, device: torch.device
) -> EagleDraft:
    """The draft in ``folder`` for a target of ``hidden_size`` and ``vocab_size``, in ``dtype``
    on ``device``. ValueError for a pickle, a shape that does not fit the target, or a tensor
    missing or left over."""
    folder = folder.expanduser()
    config = read_eagle_config(folder)
    layer = config.layer_config
    if layer.hidden_size != hidden_size:
        raise ValueError(
            f"the EAGLE draft in {folder} reads features of {layer.hidden_size}, the target's hidden states are "
            f"{hidden_size}: it was trained for another model"
        )
    if layer.vocab_size != vocab_size:
        raise ValueError(
            f"the EAGLE draft in {folder} has a vocabulary of {layer.vocab_size} tokens, the target's has "
            f"{vocab_size}: it was trained for another model"
        )
    weights = read_draft_weights(folder, config.layout)
    if not config.layernorms and weights.pop("layers.0.input_layernorm.weight", None) is not None:
        # Some conversions keep layer 0's input norm, which EAGLE never applies.
        logger.info("EAGLE draft %s: layer 0's input norm is in the file but unused, as EAGLE's", folder)
    shape = EagleDraftShape.from_layer_config(
        layer,
        num_layers=config.num_layers,
        fc_bias=config.fusion_bias if config.fusion_bias is not None else "fc.bias" in weights,
        layernorms=config.layernorms,
        own_embedding="embed_tokens.weight" in weights,
        own_lm_head="lm_head.weight" in weights,
    )
    draft = EagleDraft(shape, max_positions, layer, dtype)
    which = f"the EAGLE draft in {folder}"
    load_weights(draft, weights, which, f"{config.num_layers} layer(s), {config.layout} layout")
    logger.info(
        "EAGLE draft %s (%s layout): %d layer(s), %s embedding, %s LM head%s",
        folder,
        config.layout,
        config.num_layers,
        "its own" if shape.own_embedding else "the target's",
        "its own" if shape.own_lm_head else "the target's",
        ", extra layernorms" if shape.layernorms else "",
    )
    return draft.to(device=device, dtype=dtype).eval()


def load_weights(draft: nn.Module, weights: dict[str, torch.Tensor], which: str, config: str) -> None:
    """``weights`` into ``draft``; ValueError naming ``which`` draft and its ``config`` (in words)
    when a tensor is missing or left over."""
    missing, unexpected = draft.load_state_dict(weights, strict=False)
    if missing or unexpected:
        raise ValueError(
            f"{which} does not match its config ({config}): missing {missing[:4]}, unexpected {unexpected[:4]}"
        )


def layer_config_fields(draft: EagleDraft | Eagle3Draft) -> dict[str, Any]:
    """The draft's layer config as a checkpoint's config names it (a Llama layer's)."""
    layer = {k: v for k, v in draft.layer_config.to_dict().items() if k not in ("architectures", "model_type")}
    layer.update(model_type="llama", num_hidden_layers=draft.shape.num_layers)
    return layer


def write_draft(folder: Path, config: dict[str, object], tensors: dict[str, torch.Tensor]) -> None:
    """``config.json`` and ``model.safetensors`` in ``folder`` (made if missing)."""
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")


def draft_tensors(draft: nn.Module) -> dict[str, torch.Tensor]:
    """The draft's state as safetensors writes it."""
    return {name: tensor.detach().contiguous().cpu() for name, tensor in draft.state_dict().items()}


def save_eagle_draft(draft: EagleDraft, folder: Path, layout: EagleLayout, extra: dict[str, object]) -> None:
    """Write ``draft`` in ``layout`` (``config.json``, ``model.safetensors``); ``extra``: more
    config keys (what it was trained for and on)."""
    shape = draft.shape
    layer = {**layer_config_fields(draft), "architectures": ["LlamaForCausalLM"]}
    if layout == "speculators":
        if shape.num_layers != 1:
            raise ValueError("the speculators layout holds one-layer EAGLE drafts only")
        config: dict[str, object] = {
            "speculators_model_type": "eagle",
            "architectures": ["EagleSpeculator"],
            "transformer_layer_architecture": "LlamaDecoderLayer",
            "transformer_layer_config": layer,
            "fusion_bias": shape.fc_bias,
            "layernorms": shape.layernorms,
            **extra,
        }
    else:
        if shape.layernorms:
            raise ValueError("EAGLE's reference layout has no extra layernorms; save in the speculators layout")
        config = {**layer, **extra}
    write_draft(folder, config, draft_tensors(draft))


def is_reference_eagle3(config: dict[str, Any]) -> bool:
    """Whether a config in EAGLE's reference layout is an EAGLE-3 draft's (its own vocabulary)."""
    return "draft_vocab_size" in config or any("Eagle3" in name for name in config.get("architectures") or [])


def llama_layer_config(layer: dict[str, Any], config_path: Path) -> LlamaConfig:
    missing = [
        key for key in ("hidden_size", "intermediate_size", "num_attention_heads", "vocab_size") if key not in layer
    ]
    if missing:
        raise ValueError(f"{config_path}: the EAGLE draft's layer config lacks {missing}")
    if layer.get("hidden_act", "silu") != "silu":
        raise ValueError(f"{config_path}: only the silu MLP activation is supported, not {layer['hidden_act']!r}")
    return LlamaConfig(**{k: v for k, v in layer.items() if k not in ("architectures", "model_type")})


def read_draft_weights(folder: Path, layout: EagleLayout) -> dict[str, torch.Tensor]:
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        refuse_pickles(folder, "EAGLE draft's weights", "model.safetensors")
        raise ValueError(f"the EAGLE draft in {folder} has no weights: expected *.safetensors")
    weights: dict[str, torch.Tensor] = {}
    for path in files:
        for name, tensor in load_file(str(path)).items():
            for prefix in _PREFIXES:
                name = name.removeprefix(prefix)
            weights[name] = tensor
    return weights
