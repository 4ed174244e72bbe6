"""Load a GGUF file into :class:`LlamaFamilyForCausalLM`, its quantized tensors kept quantized.

The file is read with the ``gguf`` package's reader. Its llama.cpp tensor names map onto
the Hugging Face names the model loads by (``blk.3.attn_q.weight`` ->
``model.layers.3.self_attn.q_proj.weight``), and the row permutation llama.cpp's converter
applies to a llama model's Q and K projections for its rotary layout is undone: it moves
whole rows, so it applies to quantized rows as they are. The config and tokenizer come from
the file's metadata (engine/gguf_files.py).

On the CPU, with the native kernels, Q4_0, Q4_1 and Q8_0 tensors stay in their blocks:

- a fused projection (q/k/v, gate/up) whose parts share one format is one
  :class:`QuantizedLinear` over their rows; a group mixing formats is dequantized to the
  compute dtype (logged) and runs as a float linear layer;
- the embedding table, when quantized, is a :class:`QuantizedEmbedding`, and a tied LM head a
  :class:`QuantizedLinear` over the same blocks;
- under tensor parallelism each rank takes its rows, or its columns on whole 32-element blocks
  (:meth:`QuantizedWeight.columns` refuses any other split), as ``shard_of`` says for floats.

F32, F16 and BF16 tensors (the norms, maybe the embedding) load as a safetensors checkpoint's
do; other quantized types (the K-quants) are dequantized at load, for want of kernels yet.
Elsewhere (another device, no native kernels) every tensor is dequantized at load and the model
is an ordinary float one.

The model is built on the meta device, so that no float copy of a quantized weight is ever
allocated; what stays float is then allocated and loaded, and the rotary tables (computed at
construction, so meta too) are computed again on the CPU.
"""

from __future__ import annotations

import logging
from collections import Counter, defaultdict
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFReader, ReaderTensor
from gguf.quants import dequantize as gguf_dequantize
from torch import nn
from transformers import PretrainedConfig

from engine import cpu_kernels
from engine.attention.backend import AttentionBackend
from engine.cpu_quant_kernels import QuantKernels
from engine.models.llama import LlamaFamilyForCausalLM, ShardSlice, TensorParallel, map_name
from engine.models.ops import ModelOps
from engine.models.quant_format import QUANT_FORMATS, QuantizedWeight
from engine.models.quantized_linear import QuantizedEmbedding, QuantizedLinear, activation_mode
from engine.models.rotary import RotaryEmbedding

logger = logging.getLogger(__name__)

_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_FORMAT_BY_TYPE = {quant_format.ggml_type: quant_format for quant_format in QUANT_FORMATS.values()}
_FLOAT_TYPES = {
    GGMLQuantizationType.F32: torch.float32,
    GGMLQuantizationType.F16: torch.float16,
    GGMLQuantizationType.BF16: torch.bfloat16,
}

Payload = torch.Tensor | QuantizedWeight


def hf_name(gguf_name: str) -> str | None:
    """``blk.3.attn_q.weight`` -> ``model.layers.3.self_attn.q_proj.weight``; None for tensors
    the model has no place for (llama.cpp's ``rope_freqs``, computed from the config instead)."""
    base, _, suffix = gguf_name.rpartition(".")
    if base in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[base]}.{suffix}"
    parts = base.split(".")
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in _LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}.{suffix}"
    return None


def unpermute_order(num_rows: int, num_heads: int) -> torch.Tensor:
    """The row order that undoes llama.cpp's rotary permutation of a Q or K projection of
    ``num_heads`` heads (transformers' ``LlamaTensorProcessor._reverse_permute_weights``)."""
    half_dim = num_rows // num_heads // 2
    return torch.arange(num_rows).view(num_heads, half_dim, 2).transpose(1, 2).reshape(-1)


@dataclass(slots=True)
class GGUFTensors:
    """What a GGUF file holds, under Hugging Face names, in file order."""

    tensors: list[tuple[str, Payload]]
    skipped: list[str]  # llama.cpp tensors without a place in the model
    dequantized_types: Counter[str]  # types without kernels, dequantized at load

    @classmethod
    def read(cls, path: Path, config: PretrainedConfig) -> GGUFTensors:
        reader = GGUFReader(str(path))
        # llama.cpp permutes the Q and K rows of the models it converts as "llama" only.
        permuted = reader.fields["general.architecture"].contents() == "llama"
        num_heads = config.num_attention_heads
        heads_of = {"self_attn.q_proj": num_heads, "self_attn.k_proj": config.num_key_value_heads or num_heads}
        result = cls([], [], Counter())
        for tensor in reader.tensors:
            name = hf_name(tensor.name)
            if name is None:
                result.skipped.append(tensor.name)
                continue
            payload = result._payload(tensor)
            projection = next((p for p in heads_of if f".{p}." in name), None)
            if permuted and projection is not None:
                order = unpermute_order(_num_rows(payload), heads_of[projection])
                payload = payload.permute_rows(order) if isinstance(payload, QuantizedWeight) else payload[order]
            result.tensors.append((name, payload))
        return result

    def _payload(self, tensor: ReaderTensor) -> Payload:
        shape = tuple(int(n) for n in reversed(tensor.shape))  # ggml lists dimensions innermost first
        quant_format = _FORMAT_BY_TYPE.get(int(tensor.tensor_type))
        if quant_format is not None:
            return QuantizedWeight(quant_format, torch.from_numpy(np.array(tensor.data)), shape[-1])
        dtype = _FLOAT_TYPES.get(tensor.tensor_type)
        if dtype is None:
            self.dequantized_types[tensor.tensor_type.name] += 1
            return torch.from_numpy(gguf_dequantize(tensor.data, tensor.tensor_type).reshape(shape))
        raw = torch.from_numpy(np.array(tensor.data).view(np.uint8).reshape(-1))
        return raw.view(dtype).reshape(shape)


def _num_rows(payload: Payload) -> int:
    return payload.out_features if isinstance(payload, QuantizedWeight) else payload.shape[0]


def _shard(model: LlamaFamilyForCausalLM, name: str, weight: QuantizedWeight) -> QuantizedWeight:
    """This rank's part of a quantized weight (the whole of it without tensor parallelism)."""
    shard = model.shard_of(name, weight.out_features)
    if not isinstance(shard, ShardSlice):
        if shard == "none":
            raise RuntimeError(f"no rank holds quantized weight {name} (bug: only biases are rank 0's)")
        return weight
    part = weight.rows(shard.start, shard.count) if shard.dim == 0 else weight.columns(shard.start, shard.count)
    return part.pad_rows(shard.padding) if shard.padding else part


def load_gguf(
    path: Path,
    config: PretrainedConfig,
    architecture: str,
    max_positions: int,
    dtype: torch.dtype,
    device: torch.device,
    backend: AttentionBackend,
    ops: ModelOps,
    parallel: TensorParallel | None,
) -> LlamaFamilyForCausalLM:
    """The model of GGUF file ``path`` (its ``config`` from engine/gguf_files.py), this rank's
    shard of it under ``parallel``, quantized where the module docstring says."""
    contents = GGUFTensors.read(path, config)
    if contents.skipped:
        logger.info("%s: tensors without a place in the model, skipped: %s", path.name, ", ".join(contents.skipped))
    if contents.dequantized_types:
        logger.warning(
            "%s: no kernels for %s yet: those tensors are dequantized to %s at load",
            path.name,
            ", ".join(f"{count} {name}" for name, count in sorted(contents.dequantized_types.items())),
            dtype,
        )
    kernels = cpu_kernels.load() if device.type == "cpu" else None
    if kernels is None or not kernels.quant.supports(dtype):
        reason = "no native CPU kernels" if device.type == "cpu" else f"no quantized kernels on {device.type}"
        logger.warning("%s: every weight dequantized to %s at load (%s)", path.name, dtype, reason)
        with torch.device(device):
            model = LlamaFamilyForCausalLM(config, architecture, max_positions, dtype, backend, ops, parallel).to(dtype)
        model.load_weights(_dequantized(contents.tensors))
        return model

    with torch.device("meta"):
        model = LlamaFamilyForCausalLM(config, architecture, max_positions, dtype, backend, ops, parallel).to(dtype)
    floats = _quantize_modules(model, contents.tensors, kernels.quant, dtype)
    _materialize(model, RotaryEmbedding(config, model.shape.head_dim, max_positions, dtype, ops))
    model.load_weights(floats)
    return model


def _dequantized(tensors: list[tuple[str, Payload]]) -> Iterator[tuple[str, torch.Tensor]]:
    for name, payload in tensors:
        yield name, payload.dequantize() if isinstance(payload, QuantizedWeight) else payload


def _quantize_modules(
    model: LlamaFamilyForCausalLM,
    tensors: list[tuple[str, Payload]],
    kernels: QuantKernels,
    dtype: torch.dtype,
) -> list[tuple[str, torch.Tensor]]:
    """Put every quantized weight of ``tensors`` in its module (replacing ``nn.Linear`` by
    :class:`QuantizedLinear`, ``nn.Embedding`` by :class:`QuantizedEmbedding`). Returns what
    the float loader takes: the float tensors, and groups dequantized for mixing formats."""
    tied, activations = model.shape.tie_word_embeddings, activation_mode()
    fused = model.fused_projections()
    floats: list[tuple[str, torch.Tensor]] = []
    # module name -> [(row offset, HF name, weight)]
    groups: defaultdict[str, list[tuple[int, str, QuantizedWeight]]] = defaultdict(list)
    embedding: QuantizedWeight | None = None
    for name, payload in tensors:
        if name.startswith("lm_head.") and tied:
            continue  # tied: the head is the embedding
        if not isinstance(payload, QuantizedWeight):
            floats.append((name, payload))
        elif name == "model.embed_tokens.weight":
            embedding = payload
        else:
            target, offset, _ = map_name(name, fused)
            groups[target.removesuffix(".weight")].append((offset or 0, name, payload))
    if embedding is not None:
        _replace(model, "embed_tokens", QuantizedEmbedding(embedding, kernels, dtype))
        if tied:
            head = embedding if model.layout is None else _shard(model, "lm_head.weight", embedding)
            _replace(model, "lm_head", QuantizedLinear(head, None, kernels, activations))
    counts: Counter[str] = Counter()
    for module_name, parts in groups.items():
        parts.sort(key=lambda part: part[0])
        if len({weight.format for _, _, weight in parts}) > 1:
            formats = ", ".join(f"{name}: {weight.format.name}" for _, name, weight in parts)
            logger.warning("%s mixes formats (%s): dequantized to %s", module_name, formats, dtype)
            floats += [(name, weight.dequantize()) for _, name, weight in parts]
            continue
        weight = QuantizedWeight.cat_rows([_shard(model, name, weight) for _, name, weight in parts])
        linear = model.get_submodule(module_name)
        if not isinstance(linear, nn.Linear) or (linear.out_features, linear.in_features) != weight.shape:
            raise ValueError(
                f"GGUF tensors {[name for _, name, _ in parts]} make a {weight.shape} weight, the model's "
                f"{module_name} is {getattr(linear, 'weight', linear)!r}"
            )
        _replace(model, module_name, QuantizedLinear(weight, linear.bias, kernels, activations))
        counts[weight.format.name] += len(parts)
    if embedding is not None:
        counts[embedding.format.name] += 1
    quantized_bytes = sum(m.qweight.nbytes for m in model.modules() if isinstance(m, QuantizedLinear))
    logger.info(
        "kept quantized: %s tensors (%.1f MiB in linear layers), activations %s in the kernels",
        ", ".join(f"{count} {name}" for name, count in sorted(counts.items())) or "no",
        quantized_bytes / 2**20,
        activations,
    )
    return floats


def _replace(model: nn.Module, name: str, module: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent_name) if parent_name else model, child, module)


def _materialize(model: LlamaFamilyForCausalLM, rotary: RotaryEmbedding) -> None:
    """Allocate on the CPU every parameter still on the meta device (tied ones stay tied), and
    put ``rotary``'s tables, computed on the CPU, in place of the meta ones."""
    allocated: dict[int, nn.Parameter] = {}
    for module in model.modules():
        for key, param in module.named_parameters(recurse=False):
            if param.is_meta:
                if id(param) not in allocated:
                    allocated[id(param)] = nn.Parameter(torch.empty_like(param, device="cpu"), param.requires_grad)
                setattr(module, key, allocated[id(param)])
    model.rotary.cos, model.rotary.sin = rotary.cos, rotary.sin
    left = [name for name, tensor in [*model.named_parameters(), *model.named_buffers()] if tensor.is_meta]
    if left:
        raise RuntimeError(f"{left[:5]} still on the meta device after loading a GGUF file (bug: a new buffer?)")
