"""EAGLE-3 drafts on disk: the two layouts published drafts come in, read from safetensors only.

- **EAGLE's reference repository** (SafeAILab/EAGLE, e.g. yuhuili/EAGLE3-LLaMA3.1-Instruct-8B):
  ``config.json`` is a Llama config of the draft's layer (``vocab_size`` the target's) plus
  ``draft_vocab_size`` (and ``target_hidden_size`` where the draft is narrower than the target);
  weights ``fc.weight`` ([hidden, 3 * target_hidden]), ``midlayer.{input_layernorm,hidden_norm,
  post_attention_layernorm}.weight``, ``midlayer.self_attn.{q,k,v}_proj.weight`` (reading
  ``2 * hidden``), ``midlayer.self_attn.o_proj.weight``, ``midlayer.mlp.*``, ``norm.weight``,
  ``lm_head.weight`` ([draft_vocab, hidden]), ``d2t`` (draft id -> offset to the target's id),
  ``t2d`` (a mask over the target vocabulary), sometimes ``embed_tokens.weight``.
- **The ``speculators`` package's** (``"speculators_model_type": "eagle3"``, which vLLM reads):
  the layer's Llama config under ``transformer_layer_config``, and ``draft_vocab_size``,
  ``norm_before_residual``, ``target_hidden_size``, ``eagle_aux_hidden_state_layer_ids`` beside
  it; the same tensors with ``layers.0.`` for ``midlayer.``.

The target layers whose inputs the draft fuses are the config's ``eagle_aux_hidden_state_layer_ids``
when it names them, else EAGLE-3's and vLLM's default ``(2, L // 2, L - 3)`` for a target of ``L``
layers. A missing ``embed_tokens`` is the target's; a missing ``d2t`` is allowed only for a draft
vocabulary as large as the target's. Pickles are refused as EAGLE-1's loader refuses them.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import LlamaConfig

from engine.spec_decode.eagle3_draft import Eagle3Draft, Eagle3Shape
from engine.spec_decode.eagle_checkpoint import (
    EagleLayout,
    draft_tensors,
    is_reference_eagle3,
    layer_config_fields,
    llama_layer_config,
    load_weights,
    read_draft_weights,
    write_draft,
)
from engine.spec_decode.eagle_draft import EagleDraftShape

logger = logging.getLogger(__name__)

_REFERENCE_LAYER_PREFIX = "midlayer."
_LAYER_PREFIX = "layers.0."


@dataclass(frozen=True, slots=True)
class Eagle3CheckpointConfig:
    layout: EagleLayout  # "eagle": the reference repository's; "speculators"
    layer_config: LlamaConfig
    num_layers: int
    draft_vocab_size: int
    target_hidden_size: int
    feature_layer_ids: tuple[int, ...] | None  # None: the default for the target's depth
    norm_before_residual: bool


def default_feature_layer_ids(num_target_layers: int) -> tuple[int, ...]:
    """EAGLE-3's low, middle and high layers of a target of ``num_target_layers``, as vLLM takes them."""
    return (2, num_target_layers // 2, num_target_layers - 3)


def read_eagle3_config(folder: Path) -> Eagle3CheckpointConfig:
    """The draft's shape from ``folder/config.json``; ValueError, saying what is missing, for a
    folder that is not an EAGLE-3 draft."""
    config_path = folder.expanduser() / "config.json"
    if not config_path.is_file():
        raise ValueError(f"EAGLE-3 draft: {folder} has no config.json; give the folder of an EAGLE-3 checkpoint")
    config: dict[str, Any] = json.loads(config_path.read_text())
    kind = config.get("speculators_model_type")
    if kind is not None:
        if kind != "eagle3":
            raise ValueError(f"{config_path} is a speculators {kind!r} model, not an EAGLE-3 draft ('eagle3')")
        for option in ("norm_before_fc", "fc_norm"):
            if config.get(option):
                raise ValueError(f"{config_path}: EAGLE-3 drafts with {option} are not served here yet")
        layer = config.get("transformer_layer_config")
        if not isinstance(layer, dict):
            raise ValueError(f"{config_path} (speculators eagle3) has no transformer_layer_config")
        layout: EagleLayout = "speculators"
    elif is_reference_eagle3(config):
        layer, layout = config, "eagle"
    else:
        raise ValueError(
            f"{config_path} is not an EAGLE-3 draft's config (no draft_vocab_size, no speculators_model_type "
            '\'eagle3\'); an EAGLE-1/2 draft is served with "method": "eagle"'
        )
    layer_config = llama_layer_config(layer, config_path)
    ids = config.get("eagle_aux_hidden_state_layer_ids")
    return Eagle3CheckpointConfig(
        layout=layout,
        layer_config=layer_config,
        # Not LlamaConfig's default of 32: a layer config that says nothing is one layer's.
        num_layers=int(layer.get("num_hidden_layers", 1)),
        draft_vocab_size=int(config.get("draft_vocab_size") or layer_config.vocab_size),
        target_hidden_size=int(config.get("target_hidden_size") or layer_config.hidden_size),
        feature_layer_ids=tuple(int(i) for i in ids) if ids else None,
        norm_before_residual=bool(config.get("norm_before_residual", False)),
    )


def load_eagle3_draft(
    folder: Path,
    hidden_size: int,
    vocab_size: int,
    num_target_layers: int,
    max_positions: int,
    dtype: torch.dtype,
    device: torch.device,
) -> Eagle3Draft:
    """The EAGLE-3 draft in ``folder`` for a target of ``hidden_size``, ``vocab_size`` and
    ``num_target_layers``, in ``dtype`` on ``device``. ValueError for a pickle, a shape that does
    not fit the target, a vocabulary map out of range, or a tensor missing or left over."""
    folder = folder.expanduser()
    config = read_eagle3_config(folder)
    layer = config.layer_config
    if config.target_hidden_size != hidden_size:
        raise ValueError(
            f"the EAGLE-3 draft in {folder} reads hidden states of {config.target_hidden_size}, the target's are "
            f"{hidden_size}: it was trained for another model"
        )
    if layer.vocab_size != vocab_size:
        raise ValueError(
            f"the EAGLE-3 draft in {folder} maps its vocabulary into one of {layer.vocab_size} tokens, the "
            f"target's has {vocab_size}: it was trained for another model"
        )
    ids = _feature_layer_ids(config.feature_layer_ids, num_target_layers, folder)
    weights = read_draft_weights(folder, config.layout)
    weights = {
        _LAYER_PREFIX + k.removeprefix(_REFERENCE_LAYER_PREFIX) if k.startswith(_REFERENCE_LAYER_PREFIX) else k: v
        for k, v in weights.items()
    }
    fc = weights.get("fc.weight")
    if fc is not None and fc.shape[1] != len(ids) * hidden_size:
        raise ValueError(
            f"the EAGLE-3 draft in {folder} fuses {fc.shape[1]} features, but reads target layers {list(ids)} of "
            f"{hidden_size} each; name its layers in config.json's eagle_aux_hidden_state_layer_ids"
        )
    if "d2t" not in weights:
        if config.draft_vocab_size != vocab_size:
            raise ValueError(
                f"the EAGLE-3 draft in {folder} has a vocabulary of {config.draft_vocab_size} tokens and no d2t "
                "mapping it to the target's"
            )
        weights["d2t"] = torch.zeros(config.draft_vocab_size, dtype=torch.int64)
    d2t = weights["d2t"] = weights["d2t"].to(torch.int64)
    if d2t.shape != (config.draft_vocab_size,):
        raise ValueError(
            f"the EAGLE-3 draft in {folder}: d2t has {d2t.numel()} entries, its vocabulary {config.draft_vocab_size}"
        )
    target_ids = torch.arange(config.draft_vocab_size) + d2t
    if not ((target_ids >= 0) & (target_ids < vocab_size)).all():
        raise ValueError(f"the EAGLE-3 draft in {folder}: d2t maps draft tokens outside the target's vocabulary")
    t2d = weights.pop("t2d", None)
    if t2d is not None and (t2d.shape != (vocab_size,) or not t2d.bool()[target_ids].all()):
        raise ValueError(f"the EAGLE-3 draft in {folder}: its d2t and t2d disagree on the draft vocabulary")
    own_embedding = "embed_tokens.weight" in weights
    if not own_embedding and layer.hidden_size != hidden_size:
        raise ValueError(f"the EAGLE-3 draft in {folder} is narrower than the target and has no embed_tokens")
    shape = EagleDraftShape.from_layer_config(
        layer,
        num_layers=config.num_layers,
        fc_bias=False,
        layernorms=False,
        own_embedding=own_embedding,
        own_lm_head=True,
    )
    eagle3 = Eagle3Shape(config.draft_vocab_size, config.target_hidden_size, ids, config.norm_before_residual)
    draft = Eagle3Draft(shape, eagle3, max_positions, layer, dtype)
    load_weights(draft, weights, f"the EAGLE-3 draft in {folder}", f"{config.layout} layout")
    logger.info(
        "EAGLE-3 draft %s (%s layout): target layers %s, a draft vocabulary of %d, %s embedding",
        folder,
        config.layout,
        list(ids),
        config.draft_vocab_size,
        "its own" if own_embedding else "the target's",
    )
    return draft.to(device=device, dtype=dtype).eval()


def _feature_layer_ids(given: tuple[int, ...] | None, num_target_layers: int, folder: Path) -> tuple[int, ...]:
    ids = given if given is not None else default_feature_layer_ids(num_target_layers)
    where = "its config's eagle_aux_hidden_state_layer_ids" if given is not None else "EAGLE-3's default layers"
    if len(set(ids)) != len(ids) or not all(0 <= i < num_target_layers for i in ids):
        raise ValueError(
            f"the EAGLE-3 draft in {folder} reads target layers {list(ids)} ({where}), which a target of "
            f"{num_target_layers} layers does not have as distinct layers; name them in config.json's "
            "eagle_aux_hidden_state_layer_ids"
        )
    return tuple(sorted(ids))  # the target hands them over in layer order, as vLLM's does


def save_eagle3_draft(draft: Eagle3Draft, folder: Path, layout: EagleLayout, extra: dict[str, object]) -> None:
    """Write ``draft`` in ``layout`` (``config.json``, ``model.safetensors`` with ``d2t`` and
    ``t2d``); ``extra``: more config keys (what it was trained for and on)."""
    shape, eagle3 = draft.shape, draft.eagle3
    layer = layer_config_fields(draft)
    fields = {
        "draft_vocab_size": eagle3.draft_vocab_size,
        "target_hidden_size": eagle3.target_hidden_size,
        "eagle_aux_hidden_state_layer_ids": list(eagle3.feature_layer_ids),
    }
    tensors = draft_tensors(draft)
    t2d = torch.zeros(shape.vocab_size, dtype=torch.bool)
    t2d[torch.arange(eagle3.draft_vocab_size) + tensors["d2t"]] = True
    tensors["t2d"] = t2d
    if layout == "speculators":
        config: dict[str, object] = {
            "speculators_model_type": "eagle3",
            "architectures": ["Eagle3Speculator"],
            "transformer_layer_config": {**layer, "architectures": ["LlamaForCausalLM"]},
            "norm_before_residual": eagle3.norm_before_residual,
            "speculators_config": {"algorithm": "eagle3"},
            **fields,
            **extra,
        }
    else:
        if eagle3.norm_before_residual:
            raise ValueError("EAGLE's reference layout has no norm_before_residual; save in the speculators layout")
        config = {**layer, "architectures": ["LlamaForCausalLMEagle3"], **fields, **extra}
        tensors = {
            _REFERENCE_LAYER_PREFIX + k.removeprefix(_LAYER_PREFIX) if k.startswith(_LAYER_PREFIX) else k: v
            for k, v in tensors.items()
        }
    write_draft(folder, config, tensors)
