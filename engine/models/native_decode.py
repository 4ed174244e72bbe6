"""A decode step of a Llama-family model on the CPU in one native call (engine/csrc/decode_step.c).

The model's PyTorch modules run a decode step as some 15 kernel calls per layer with
Python in between; ``decode_forward`` runs the same kernels in the same order from C,
so its logits are bit-identical, without the interpreter between the calls and with the
GIL released once for the whole pass instead of at every call (the serving process's
event loop streams tokens meanwhile: engine/csrc/decode_step.c says what that cost).

It takes a step when every row is a decode token that wants logits (decodes, and
speculative verification rows) and the batch is no larger than the panel kernel takes
in every linear layer; any other step, and any model it cannot take (another device,
no native kernels, a linear path without panels), runs the modules. :func:`build` says
why not, once, in the log.

Call sequence: ``ModelRunner.execute`` -> :meth:`NativeDecodeStep.__call__` (engine
thread, holding the GIL) -> ``decode_forward`` through ctypes (GIL released until it
returns) -> the logits tensor, or None when the step is not one it takes.
"""

from __future__ import annotations

import ctypes
import logging

import torch
from torch import nn

from engine import cpu_kernels
from engine.attention.torch_backend import TorchAttentionBackend
from engine.flat_batch import FlatBatch
from engine.kv_cache_dtype import layer_format
from engine.models.cpu_linear import BF16WeightLinear, PackedLinear
from engine.models.llama import LlamaFamilyForCausalLM
from engine.models.ops import NativeCPUOps
from engine.models.quantized_linear import QuantizedEmbedding, QuantizedLinear

logger = logging.getLogger(__name__)

_P, _I64 = ctypes.c_void_p, ctypes.c_int64
_DECODE_ERRORS = {
    -1: "no memory for the step's activations",
    -2: "a token id outside the vocabulary reached the model (bug: the engine validates them)",
    -3: "the attention kernel refused the model's head sizes (bug: build() checks them)",
}


class _Layer(ctypes.Structure):
    """``DecodeLayer`` of decode_step.c, field for field."""

    _fields_ = [
        (name, _P)
        for name in (
            "input_norm",
            "post_attention_norm",
            "qkv",
            "qkv_bias",
            "o",
            "o_bias",
            "gate_up",
            "gate_up_bias",
            "down",
            "down_bias",
            "key_cache",
            "value_cache",
        )
    ]


class _Model(ctypes.Structure):
    """``DecodeModel`` of decode_step.c, field for field."""

    _fields_ = [
        *[
            (name, _I64)
            for name in (
                "num_layers",
                "hidden",
                "intermediate",
                "num_heads",
                "num_kv_heads",
                "head_dim",
                "vocab_size",
                "block_size",
                "block_stride",
            )
        ],
        ("rms_norm_eps", ctypes.c_float),
        ("scale", ctypes.c_float),
        ("is_bf16", _I64),
        ("kv_format", _I64),
        *[(name, _P) for name in ("embedding", "final_norm", "head", "head_bias", "cos", "sin")],
        ("layers", ctypes.POINTER(_Layer)),
    ]


class NativeDecodeStep:
    """Decode steps of one model over one KV cache; :func:`build` makes it."""

    def __init__(
        self,
        kernels: cpu_kernels.CPUKernels,
        model: LlamaFamilyForCausalLM,
        layer_caches: list[torch.Tensor],
        max_rows: int,
    ) -> None:
        self.kernels = kernels
        self.max_rows = max_rows
        # The struct holds raw pointers: these keep what they point at alive.
        self._model, self._layer_caches = model, layer_caches
        shape, dtype = model.shape, model.embed_tokens.weight.dtype
        first_cache = layer_caches[0]
        self._layers = (_Layer * shape.num_layers)(
            *[_layer_struct(layer, cache) for layer, cache in zip(model.layers, layer_caches, strict=True)]
        )
        self._struct = _Model(
            num_layers=shape.num_layers,
            hidden=shape.hidden_size,
            intermediate=shape.intermediate_size,
            num_heads=shape.num_heads,
            num_kv_heads=shape.num_kv_heads,
            head_dim=shape.head_dim,
            vocab_size=shape.vocab_size,
            block_size=first_cache.shape[2],
            block_stride=first_cache.stride(1),
            rms_norm_eps=shape.rms_norm_eps,
            scale=model.layers[0].scale,
            is_bf16=int(dtype == torch.bfloat16),
            kv_format=cpu_kernels.kv_format_code(first_cache),
            embedding=model.embed_tokens.weight.data_ptr(),
            final_norm=model.norm.weight.data_ptr(),
            head=model.lm_head.panels.data_ptr(),
            head_bias=_pointer(model.lm_head.bias),
            cos=model.rotary.cos.data_ptr(),
            sin=model.rotary.sin.data_ptr(),
            layers=self._layers,
        )

    def __call__(self, batch: FlatBatch) -> torch.Tensor | None:
        """Float32 logits [T, vocab_size] of a step whose T rows are all decode tokens wanting
        logits, with T <= :attr:`max_rows`; None for any other step (the modules run it)."""
        metadata = batch.metadata
        num_rows = batch.input_ids.shape[0]
        if num_rows > self.max_rows or metadata.num_decodes != num_rows or batch.logits_indices.shape[0] != num_rows:
            return None
        logits = torch.empty((num_rows, self._struct.vocab_size), dtype=torch.float32)
        block_tables = metadata.block_tables
        status = self.kernels.decode_forward(
            ctypes.addressof(self._struct),
            batch.input_ids.data_ptr(),
            batch.positions.data_ptr(),
            metadata.slot_mapping.data_ptr(),
            block_tables.data_ptr(),
            block_tables.stride(0),
            metadata.seq_lens.data_ptr(),
            num_rows,
            logits.data_ptr(),
        )
        if status == -1:
            raise MemoryError(f"decode step of {num_rows} rows: {_DECODE_ERRORS[status]}")
        if status != 0:
            raise RuntimeError(f"decode step of {num_rows} rows: {_DECODE_ERRORS.get(status, status)}")
        return logits


def build(model: nn.Module, layer_caches: list[torch.Tensor]) -> NativeDecodeStep | None:
    """The native decode step for ``model`` over ``layer_caches``, or None (logged) when it
    cannot take this model as prepared."""
    kernels = cpu_kernels.load()
    reason = _unsupported(model, layer_caches, kernels)
    if reason is not None:
        logger.info("decode steps: the model's modules, one kernel call at a time (%s)", reason)
        return None
    max_rows = min(linear.max_kernel_rows for linear in _linears(model))
    logger.info("decode steps of up to %d rows: one native call each", max_rows)
    return NativeDecodeStep(kernels, model, layer_caches, max_rows)


def _linears(model: LlamaFamilyForCausalLM) -> list[nn.Module]:
    return [model.lm_head] + [
        getattr(layer, name) for layer in model.layers for name in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
    ]


def _unsupported(
    model: nn.Module, layer_caches: list[torch.Tensor], kernels: cpu_kernels.CPUKernels | None
) -> str | None:
    """Why the native step cannot run ``model``; None when it can."""
    if kernels is None:
        return "no native CPU kernels"
    if not isinstance(model, LlamaFamilyForCausalLM):
        return f"no native step for {type(model).__name__}"
    if model.group is not None:
        return "tensor parallel: the ranks all-reduce between a layer's kernels"
    if any(isinstance(module, QuantizedLinear | QuantizedEmbedding) for module in model.modules()):
        return "quantized weights: the native step strings float panels only, so far"
    weight = model.embed_tokens.weight
    if weight.device.type != "cpu" or not kernels.supports(weight.dtype):
        return f"{weight.dtype} on {weight.device.type}"
    shape = model.shape
    if not kernels.paged_decode_supports(shape.num_heads, shape.head_dim, layer_caches[0].shape[2]):
        return "head sizes beyond the native attention kernel's"
    for layer in model.layers:
        if not isinstance(layer.ops, NativeCPUOps):
            return "PyTorch elementwise ops"
        if not isinstance(layer.backend, TorchAttentionBackend) or layer.backend.cpu_kernels is None:
            return "an attention backend without the native kernels"
    linears = _linears(model)
    if not all(isinstance(m, PackedLinear | BF16WeightLinear) and m.panels is not None for m in linears):
        return "linear layers without weight panels"
    if not all(m.max_kernel_rows > 0 for m in linears):
        return "linear layers whose panels take no decode rows"
    strides = {(cache.stride(0), cache.stride(1)) for cache in layer_caches}
    contiguous_blocks = all(
        cache[0, 0].is_contiguous() and (cache.dtype == weight.dtype or layer_format(cache) is not None)
        for cache in layer_caches
    )
    if len(strides) != 1 or not contiguous_blocks:
        return "a KV cache layout the kernels do not read"
    return None


def _pointer(tensor: torch.Tensor | None) -> int | None:
    return None if tensor is None else tensor.data_ptr()


def _layer_struct(layer: nn.Module, cache: torch.Tensor) -> _Layer:
    key = cache.data_ptr()
    return _Layer(
        input_norm=layer.input_layernorm.weight.data_ptr(),
        post_attention_norm=layer.post_attention_layernorm.weight.data_ptr(),
        qkv=layer.qkv_proj.panels.data_ptr(),
        qkv_bias=_pointer(layer.qkv_proj.bias),
        o=layer.o_proj.panels.data_ptr(),
        o_bias=_pointer(layer.o_proj.bias),
        gate_up=layer.gate_up_proj.panels.data_ptr(),
        gate_up_bias=_pointer(layer.gate_up_proj.bias),
        down=layer.down_proj.panels.data_ptr(),
        down_bias=_pointer(layer.down_proj.bias),
        key_cache=key,
        value_cache=key + cache.stride(0) * cache.element_size(),
    )
