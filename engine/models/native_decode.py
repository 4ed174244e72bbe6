"""A decode step of a Llama-family model on the CPU in one native call (engine/csrc/decode_step.c).

The model's PyTorch modules run a decode step as some 15 kernel calls per layer with
Python in between; ``decode_forward`` runs the same kernels in the same order from C,
so its logits are bit-identical, without the interpreter between the calls and with the
GIL released once for the whole pass instead of at every call (the serving process's
event loop streams tokens meanwhile: engine/csrc/decode_step.c says what that cost).

Each linear layer goes to the kernel its module calls: float panels, or a quantized weight
kept in its blocks (GGUF's formats, ``--quantization int8``), with the activation mode the
module was built with (float, or rounded to Q8_0 / Q8_K on the fly), one kernel call per run
of rows of one format for a fused projection that mixes formats; a quantized embedding
dequantizes the step's rows, and a head tied to it multiplies by its blocks.

It takes a step when every row is a decode token that wants logits (decodes, and
speculative verification rows) and the batch is no larger than the panel or quantized
kernels take in every linear layer; any other step, and any model it cannot take (another
device, no native kernels, a linear path without them), runs the modules. :func:`build`
says why not, once, in the log.

Call sequence: ``ModelRunner.execute`` -> :meth:`NativeDecodeStep.__call__` (engine
thread, holding the GIL) -> ``decode_forward`` through ctypes (GIL released until it
returns) -> the logits tensor, or None when the step is not one it takes.
"""

from __future__ import annotations

import ctypes
import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from engine import cpu_kernels
from engine.attention.torch_backend import TorchAttentionBackend
from engine.flat_batch import FlatBatch
from engine.kv_cache_dtype import layer_format
from engine.models.cpu_linear import BF16WeightLinear, PackedLinear
from engine.models.llama import LlamaFamilyForCausalLM
from engine.models.ops import NativeCPUOps
from engine.models.quantized_linear import MixedQuantizedLinear, QuantizedEmbedding, QuantizedLinear

logger = logging.getLogger(__name__)

_P, _I64 = ctypes.c_void_p, ctypes.c_int64
_DECODE_ERRORS = {
    -1: "no memory for the step's activations",
    -2: "a token id outside the vocabulary reached the model (bug: the engine validates them)",
    -3: "the attention kernel refused the model's head sizes (bug: build() checks them)",
    -4: "a quantized kernel refused a weight's format or width (bug: the loader checks them)",
}


class _QuantRun(ctypes.Structure):
    """``QuantRun`` of decode_step.c: rows of a quantized weight in one format."""

    _fields_ = [("blocks", _P), ("out_features", _I64), ("qtype", _I64), ("q8_activations", _I64)]


class _Linear(ctypes.Structure):
    """``DecodeLinear`` of decode_step.c: float panels (no runs) or runs of quantized rows."""

    _fields_ = [("panels", _P), ("bias", _P), ("num_runs", _I64), ("runs", ctypes.POINTER(_QuantRun))]


class _Layer(ctypes.Structure):
    """``DecodeLayer`` of decode_step.c, field for field."""

    _fields_ = [
        ("input_norm", _P),
        ("post_attention_norm", _P),
        *[(name, _Linear) for name in ("qkv", "o", "gate_up", "down")],
        ("key_cache", _P),
        ("value_cache", _P),
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
        ("embedding", _P),
        ("embedding_qtype", _I64),
        ("final_norm", _P),
        ("head", _Linear),
        ("cos", _P),
        ("sin", _P),
        ("layers", ctypes.POINTER(_Layer)),
    ]


@dataclass(frozen=True, slots=True)
class LayerCapture:
    """The residual streams entering some layers, captured during a native step, as
    ``LlamaFamilyForCausalLM.run_layers_capturing`` returns them (what EAGLE-3 drafts fuse)."""

    layer_ids: torch.Tensor  # capture_layer_ids' (made once: a step only allocates ``out``)
    out: torch.Tensor  # [rows, len(layer_ids) * hidden], the model's dtype, contiguous

    @classmethod
    def of(cls, layer_ids: torch.Tensor, num_rows: int, hidden: int, dtype: torch.dtype) -> LayerCapture:
        return cls(layer_ids, torch.empty(num_rows, len(layer_ids) * hidden, dtype=dtype))


def capture_layer_ids(layer_ids: Sequence[int]) -> torch.Tensor:
    """Layers to capture as ``decode_forward`` takes them: int64, ascending (0: the embeddings)."""
    if list(layer_ids) != sorted(set(layer_ids)):
        raise ValueError(f"bug: layers {list(layer_ids)} to capture are not ascending")
    return torch.tensor(list(layer_ids), dtype=torch.int64)


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
        # The struct holds raw pointers: these keep what they point at alive (the runs arrays
        # too: a struct copied into an array does not carry its references along).
        self._model, self._layer_caches = model, layer_caches
        self._runs: list[ctypes.Array[_QuantRun]] = []
        shape, dtype = model.shape, _compute_dtype(model)
        self.hidden_dtype = dtype  # of the hidden states it writes out
        first_cache = layer_caches[0]
        self._layers = (_Layer * shape.num_layers)(
            *[self._layer_struct(layer, cache) for layer, cache in zip(model.layers, layer_caches, strict=True)]
        )
        embedding = model.embed_tokens
        # A quantized table: its blocks, whose rows the step dequantizes as QuantizedEmbedding does.
        quantized = isinstance(embedding, QuantizedEmbedding)
        table = embedding.qweight.data if quantized else embedding.weight
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
            embedding=table.data_ptr(),
            embedding_qtype=embedding.qweight.format.code if quantized else 0,
            final_norm=model.norm.weight.data_ptr(),
            head=self._linear_struct(model.lm_head),
            cos=model.rotary.cos.data_ptr(),
            sin=model.rotary.sin.data_ptr(),
            layers=self._layers,
        )

    def __call__(
        self, batch: FlatBatch, final_hidden_out: torch.Tensor | None = None, capture: LayerCapture | None = None
    ) -> torch.Tensor | None:
        """Float32 logits [T, vocab_size] of a step whose T rows are all decode tokens wanting
        logits, with T <= :attr:`max_rows`; None for any other step (the modules run it). Their
        final hidden states into ``final_hidden_out`` ([T, hidden], the model's dtype) if given,
        and the residual streams entering ``capture``'s layers into its ``out``."""
        metadata = batch.metadata
        num_rows = batch.input_ids.shape[0]
        if num_rows > self.max_rows or metadata.num_decodes != num_rows or batch.logits_indices.shape[0] != num_rows:
            return None
        for out in (final_hidden_out, capture.out if capture is not None else None):
            if out is not None and not (out.dtype == self.hidden_dtype and out.is_contiguous()):
                raise RuntimeError(f"bug: hidden states go out as contiguous {self.hidden_dtype}")
        if capture is not None and capture.out.shape != (num_rows, len(capture.layer_ids) * self._struct.hidden):
            raise RuntimeError(
                f"bug: {tuple(capture.out.shape)} for {num_rows} rows of {len(capture.layer_ids)} layers"
            )
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
            _pointer(final_hidden_out),
            _pointer(capture.layer_ids if capture is not None else None),
            len(capture.layer_ids) if capture is not None else 0,
            _pointer(capture.out if capture is not None else None),
        )
        if status == -1:
            raise MemoryError(f"decode step of {num_rows} rows: {_DECODE_ERRORS[status]}")
        if status != 0:
            raise RuntimeError(f"decode step of {num_rows} rows: {_DECODE_ERRORS.get(status, status)}")
        return logits

    def _layer_struct(self, layer: nn.Module, cache: torch.Tensor) -> _Layer:
        key = cache.data_ptr()
        return _Layer(
            input_norm=layer.input_layernorm.weight.data_ptr(),
            post_attention_norm=layer.post_attention_layernorm.weight.data_ptr(),
            qkv=self._linear_struct(layer.qkv_proj),
            o=self._linear_struct(layer.o_proj),
            gate_up=self._linear_struct(layer.gate_up_proj),
            down=self._linear_struct(layer.down_proj),
            key_cache=key,
            value_cache=key + cache.stride(0) * cache.element_size(),
        )

    def _linear_struct(self, linear: nn.Module) -> _Linear:
        """What the kernel the module calls needs (``_unsupported`` has checked the module)."""
        if isinstance(linear, PackedLinear | BF16WeightLinear):
            return _Linear(panels=linear.panels.data_ptr(), bias=_pointer(linear.bias), num_runs=0, runs=None)
        parts = _runs_of(linear)
        runs = (_QuantRun * len(parts))(
            *[
                _QuantRun(
                    blocks=part.qweight.data.data_ptr(),
                    out_features=part.out_features,
                    qtype=part.qweight.format.code,
                    q8_activations=int(part.q8_activations),
                )
                for part in parts
            ]
        )
        self._runs.append(runs)
        return _Linear(panels=None, bias=_pointer(linear.bias), num_runs=len(parts), runs=runs)


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
    if not model.stage.is_whole:
        return "pipeline parallel: this process runs one stage's layers"
    dtype, device = _compute_dtype(model), model.norm.weight.device
    if device.type != "cpu" or not kernels.supports(dtype):
        return f"{dtype} on {device.type}"
    embedding = model.embed_tokens
    if isinstance(embedding, QuantizedEmbedding) and (
        embedding.kernels is not kernels.quant
        or embedding.dtype != dtype
        or embedding.qweight.shape != (model.shape.vocab_size, model.shape.hidden_size)
    ):
        return "a quantized embedding the kernels do not look up as its module does"
    shape = model.shape
    if not kernels.paged_decode_supports(shape.num_heads, shape.head_dim, layer_caches[0].shape[2]):
        return "head sizes beyond the native attention kernel's"
    for layer in model.layers:
        if not isinstance(layer.ops, NativeCPUOps):
            return "PyTorch elementwise ops"
        if not isinstance(layer.backend, TorchAttentionBackend) or layer.backend.cpu_kernels is None:
            return "an attention backend without the native kernels"
    linears = _linears(model)
    for linear in linears:
        reason = _linear_unsupported(linear, kernels)
        if reason is not None:
            return reason
    if not all(m.max_kernel_rows > 0 for m in linears):
        return "linear layers whose kernels take no decode rows"
    strides = {(cache.stride(0), cache.stride(1)) for cache in layer_caches}
    contiguous_blocks = all(
        cache[0, 0].is_contiguous() and (cache.dtype == dtype or layer_format(cache) is not None)
        for cache in layer_caches
    )
    if len(strides) != 1 or not contiguous_blocks:
        return "a KV cache layout the kernels do not read"
    return None


def _linear_unsupported(linear: nn.Module, kernels: cpu_kernels.CPUKernels) -> str | None:
    """Why the native step cannot call the kernel ``linear`` calls; None when it can."""
    if isinstance(linear, PackedLinear | BF16WeightLinear):
        return None if linear.panels is not None else "linear layers without weight panels"
    parts = _runs_of(linear)
    if not all(isinstance(part, QuantizedLinear) for part in parts):
        return f"a {type(linear).__name__} linear layer"
    # The same library's kernels as the module's, so the same code computes both paths' logits.
    if any(part.kernels is not kernels.quant for part in parts):
        return "quantized layers without this kernel build"
    return None


def _runs_of(linear: nn.Module) -> list[nn.Module]:
    """A quantized layer's runs of rows of one format: a mixed one's parts, else itself."""
    return list(linear.parts) if isinstance(linear, MixedQuantizedLinear) else [linear]


def _compute_dtype(model: LlamaFamilyForCausalLM) -> torch.dtype:
    """The model's activation dtype: its norms' (the embedding may be quantized)."""
    return model.norm.weight.dtype


def _pointer(tensor: torch.Tensor | None) -> int | None:
    return None if tensor is None else tensor.data_ptr()
