"""Build a :class:`LlamaFamilyForCausalLM` from weights some of which are quantized: what a GGUF
file holds (engine/models/gguf_loader.py) and what ``--quantization int8`` makes of a float
checkpoint (engine/models/int8_quantize.py) both load through :func:`load_quantized`.

On the CPU, with the native kernels, every :class:`QuantizedWeight` stays in its blocks:

- a fused projection (q/k/v, gate/up) whose parts share one format is one
  :class:`QuantizedLinear` over their rows; one whose parts mix formats (a Q4_K_M file's V in
  Q6_K beside Q and K in Q4_K) is a :class:`MixedQuantizedLinear`, one kernel call per run of
  rows of one format;
- the embedding table, when quantized, is a :class:`QuantizedEmbedding`, and a tied LM head a
  :class:`QuantizedLinear` over the same blocks;
- under tensor parallelism each rank takes its rows, or its columns on whole blocks
  (:meth:`QuantizedWeight.columns` refuses any other split), as ``shard_of`` says for floats.

On a GPU (or wherever ``SPLITSERVE_QUANT_KERNELS=triton`` asks for it: the tests run it on the
CPU under Triton's interpreter) the same modules call the Triton dequantizing matmul
(engine/models/triton_quant_matmul.py) instead, with the blocks on the device; weights in a
format it lacks (the K-quants) are dequantized at load into ordinary float layers. Untested on a
GPU.

Float tensors (the norms, maybe the embedding) load as a safetensors checkpoint's do.
Elsewhere (no native kernels and no Triton one, a compute dtype the kernels do not take) every
weight is dequantized at load and the model is an ordinary float one.

The model is built on the meta device, so that no float copy of a quantized weight is ever
allocated; what stays float is then allocated and loaded, and the rotary tables (computed at
construction, so meta too) are computed again on the CPU.
"""

from __future__ import annotations

import logging
import os
from collections import Counter, defaultdict
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING

import torch
from torch import nn
from transformers import PretrainedConfig

from engine import cpu_kernels
from engine.attention.backend import AttentionBackend
from engine.models.cpu_linear import replace_module
from engine.models.llama import LlamaFamilyForCausalLM, ShardSlice, TensorParallel, map_name
from engine.models.ops import ModelOps
from engine.models.quant_format import QuantizedWeight
from engine.models.quantized_linear import (
    MixedQuantizedLinear,
    QuantBackend,
    QuantizedEmbedding,
    QuantizedLinear,
)
from engine.models.rotary import RotaryEmbedding
from engine.pipeline_parallel.stages import PipelineStage

if TYPE_CHECKING:
    from engine.config import QuantActivations

logger = logging.getLogger(__name__)

Payload = torch.Tensor | QuantizedWeight
# ``triton``: the Triton kernel on any device (on the CPU, under TRITON_INTERPRET=1: for tests).
QUANT_KERNELS_ENV = "SPLITSERVE_QUANT_KERNELS"


def load_quantized(
    source: str,
    tensors: Iterable[tuple[str, Payload]],
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
    """The model of ``tensors`` (Hugging Face names, in checkpoint order), this rank's shard of it
    under ``parallel`` (of ``stage``'s layers under pipeline parallelism), quantized where the
    module docstring says. ``source`` names the checkpoint in the log; ``activations``, how the
    kernels take their inputs."""
    quant, reason = quant_backend(device, dtype)
    if quant is None:
        logger.warning("%s: every weight dequantized to %s at load (%s)", source, dtype, reason)
        with torch.device(device):
            model = LlamaFamilyForCausalLM(config, architecture, max_positions, dtype, backend, ops, parallel, stage)
            model = model.to(dtype)
        model.load_weights(_dequantized(tensors))
        return model

    with torch.device("meta"):
        model = LlamaFamilyForCausalLM(config, architecture, max_positions, dtype, backend, ops, parallel, stage)
        model = model.to(dtype)
    floats = _quantize_modules(model, tensors, quant, dtype, activations)
    with torch.device(device):
        rotary = RotaryEmbedding(config, model.shape.head_dim, max_positions, dtype, ops)
    _materialize(model, rotary, device)
    model.load_weights(floats)
    return model


def quant_backend(device: torch.device, dtype: torch.dtype) -> tuple[QuantBackend | None, str]:
    """The kernels the quantized modules call on ``device``, or None and why there are none."""
    if os.environ.get(QUANT_KERNELS_ENV) == "triton" or device.type == "cuda":
        from engine.models.triton_quant_matmul import TritonQuantKernels  # imports Triton: only here

        return TritonQuantKernels(device), ""
    if device.type != "cpu":
        return None, f"no quantized kernels on {device.type}"
    kernels = cpu_kernels.load()
    if kernels is None:
        return None, "no native CPU kernels"
    if not kernels.quant.supports(dtype):
        return None, f"no quantized kernels for {dtype}"
    return kernels.quant, ""


def keeps_quantized_weights(model: nn.Module) -> bool:
    """Whether ``model`` holds some of its weights in a quantized format (this module's loading)."""
    return any(isinstance(m, (QuantizedLinear, QuantizedEmbedding)) for m in model.modules())


def shard(model: LlamaFamilyForCausalLM, name: str, weight: QuantizedWeight) -> QuantizedWeight:
    """This rank's part of a quantized weight (the whole of it without tensor parallelism)."""
    part_of = model.shard_of(name, weight.out_features)
    if not isinstance(part_of, ShardSlice):
        if part_of == "none":
            raise RuntimeError(f"no rank holds quantized weight {name} (bug: only biases are rank 0's)")
        return weight
    if part_of.dim == 0:
        part = weight.rows(part_of.start, part_of.count)
    else:
        part = weight.columns(part_of.start, part_of.count)
    return part.pad_rows(part_of.padding) if part_of.padding else part


def _dequantized(tensors: Iterable[tuple[str, Payload]]) -> Iterator[tuple[str, torch.Tensor]]:
    for name, payload in tensors:
        yield name, payload.dequantize() if isinstance(payload, QuantizedWeight) else payload


def _quantize_modules(
    model: LlamaFamilyForCausalLM,
    tensors: Iterable[tuple[str, Payload]],
    kernels: QuantBackend,
    dtype: torch.dtype,
    activations: QuantActivations,
) -> list[tuple[str, torch.Tensor]]:
    """Put every quantized weight of ``tensors`` in its module (replacing ``nn.Linear`` by
    :class:`QuantizedLinear` or :class:`MixedQuantizedLinear`, ``nn.Embedding`` by
    :class:`QuantizedEmbedding`). Returns what the float loader takes: the float tensors."""
    tied = model.shape.tie_word_embeddings
    fused = model.fused_projections()
    floats: list[tuple[str, torch.Tensor]] = []
    # module name -> [(row offset, HF name, weight)]
    groups: defaultdict[str, list[tuple[int, str, QuantizedWeight]]] = defaultdict(list)
    embedding: QuantizedWeight | None = None
    stage = model.stage
    for name, payload in tensors:
        if name.startswith("lm_head.") and tied:
            continue  # tied: the head is the embedding
        if not stage.holds(name) and not (tied and stage.is_last and name == "model.embed_tokens.weight"):
            continue  # another pipeline stage's (a tied embedding is the last stage's head too)
        if isinstance(payload, QuantizedWeight):
            if not kernels.keeps(payload):  # a format these kernels lack: a float layer
                floats.append((name, payload.dequantize()))
                continue
            payload = kernels.place(payload)
        if not isinstance(payload, QuantizedWeight):
            floats.append((name, payload))
        elif name == "model.embed_tokens.weight":
            embedding = payload
        else:
            target, offset, _ = map_name(name, fused, stage.layers.start)
            groups[target.removesuffix(".weight")].append((offset or 0, name, payload))
    if embedding is not None:
        if stage.is_first:
            replace_module(model, "embed_tokens", QuantizedEmbedding(embedding, kernels, dtype))
        if tied and stage.is_last:
            head = embedding if model.layout is None else shard(model, "lm_head.weight", embedding)
            replace_module(model, "lm_head", QuantizedLinear(head, None, kernels, activations))
    counts: Counter[str] = Counter()
    for module_name, parts in groups.items():
        parts.sort(key=lambda part: part[0])
        linear = model.get_submodule(module_name)
        sharded = [shard(model, name, weight) for _, name, weight in parts]
        num_rows = sum(weight.out_features for weight in sharded)
        if not isinstance(linear, nn.Linear) or (linear.out_features, linear.in_features) != (
            num_rows,
            sharded[0].in_features,
        ):
            raise ValueError(
                f"checkpoint tensors {[name for _, name, _ in parts]} make a {(num_rows, sharded[0].in_features)} "
                f"weight, the model's {module_name} is {getattr(linear, 'weight', linear)!r}"
            )
        runs = _runs_of_one_format(sharded)
        if len(runs) == 1:
            module: nn.Module = QuantizedLinear(runs[0], linear.bias, kernels, activations)
        else:
            formats = ", ".join(f"{name}: {weight.format.name}" for _, name, weight in parts)
            logger.info("%s mixes formats (%s): one kernel call per format", module_name, formats)
            linears = [QuantizedLinear(run, None, kernels, activations) for run in runs]
            module = MixedQuantizedLinear(linears, linear.bias)
        replace_module(model, module_name, module)
        counts.update(weight.format.name for _, _, weight in parts)
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


def _runs_of_one_format(weights: list[QuantizedWeight]) -> list[QuantizedWeight]:
    """Consecutive weights of one format fused into one: [Q4_K, Q4_K, Q6_K] -> [Q4_K rows, Q6_K rows]."""
    runs: list[list[QuantizedWeight]] = []
    for weight in weights:
        if runs and runs[-1][0].format == weight.format:
            runs[-1].append(weight)
        else:
            runs.append([weight])
    return [run[0] if len(run) == 1 else QuantizedWeight.cat_rows(run) for run in runs]


def _materialize(model: LlamaFamilyForCausalLM, rotary: RotaryEmbedding, device: torch.device) -> None:
    """Allocate on ``device`` every parameter still on the meta device (tied ones stay tied), and
    put ``rotary``'s tables, computed there, in place of the meta ones."""
    allocated: dict[int, nn.Parameter] = {}
    for module in model.modules():
        for key, param in module.named_parameters(recurse=False):
            if param.is_meta:
                if id(param) not in allocated:
                    allocated[id(param)] = nn.Parameter(torch.empty_like(param, device=device), param.requires_grad)
                setattr(module, key, allocated[id(param)])
    model.rotary.cos, model.rotary.sin = rotary.cos, rotary.sin
    left = [name for name, tensor in [*model.named_parameters(), *model.named_buffers()] if tensor.is_meta]
    if left:
        raise RuntimeError(f"{left[:5]} still on the meta device after loading quantized weights (bug: a new buffer?)")
