"""Load a GGUF file into :class:`LlamaFamilyForCausalLM`, its quantized tensors kept quantized.

The file is read with the ``gguf`` package's reader. Its llama.cpp tensor names map onto
the Hugging Face names the model loads by (``blk.3.attn_q.weight`` ->
``model.layers.3.self_attn.q_proj.weight``), and the row permutation llama.cpp's converter
applies to a llama model's Q and K projections for its rotary layout is undone: it moves
whole rows, so it applies to quantized rows as they are. The config and tokenizer come from
the file's metadata (engine/gguf_files.py).

Q4_0, Q4_1, Q8_0 and the K-quants Q4_K, Q5_K and Q6_K stay in their blocks, as
engine/models/quantized_model.py says (on the CPU, with the native kernels); F32, F16 and BF16
tensors (the norms, maybe the embedding) load as a safetensors checkpoint's do; other quantized
types (Q5_0, Q2_K, the IQ formats, ...) are dequantized at load, for want of kernels yet, and
logged.
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFReader, ReaderTensor
from gguf.quants import dequantize as gguf_dequantize
from transformers import PretrainedConfig

from engine.attention.backend import AttentionBackend
from engine.models.llama import LlamaFamilyForCausalLM, TensorParallel
from engine.models.ops import ModelOps
from engine.models.quant_format import QUANT_FORMATS, QuantizedWeight
from engine.models.quantized_model import Payload, load_quantized
from engine.pipeline_parallel.stages import PipelineStage

if TYPE_CHECKING:
    from engine.config import QuantActivations

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
_FORMAT_BY_TYPE = {quant_format.code: quant_format for quant_format in QUANT_FORMATS.values() if quant_format.in_gguf}
_FLOAT_TYPES = {
    GGMLQuantizationType.F32: torch.float32,
    GGMLQuantizationType.F16: torch.float16,
    GGMLQuantizationType.BF16: torch.bfloat16,
}


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
    activations: QuantActivations = "float",
    stage: PipelineStage | None = None,
) -> LlamaFamilyForCausalLM:
    """The model of GGUF file ``path`` (its ``config`` from engine/gguf_files.py), this rank's
    shard of it under ``parallel`` (of ``stage``'s layers), quantized where the module docstring says."""
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
    tensors = contents.tensors
    source = path.name
    return load_quantized(
        source, tensors, config, architecture, max_positions, dtype, device, backend, ops, parallel, activations, stage
    )
