"""A speculative drafter's linear layers in the form its target's take: read once per draft
token, they must cost what the target's cost per weight, or drafting eats what it saves.

An EAGLE draft is small beside its target (one decoder layer, ``fc``, and for EAGLE-3 an LM head
over a vocabulary of its own), but the engine reads all of it for every draft token, and a target
step evicts it from the caches first. Loaded as plain ``nn.Linear`` in float32, its weights went
through torch's GEMV at well under the memory's bandwidth, four bytes a weight, while the target's
step streams 4.5-bit blocks through native kernels; so each draft pass cost a large share of a
whole target step (docs/benchmarks.md, "A draft pass in the target's form").

- A target whose weights are kept quantized (a GGUF file served as shipped, ``--quantization
  int8``): the drafter's linear layers are quantized at load to INT8 rows
  (engine/models/int8_quantize.py: per output channel, symmetric) and run by the target's
  quantized kernels with its ``--quant-activations`` mode. INT8, not the target's own 4-bit
  formats: a layer this small is cheap at one byte a weight, and INT8 is the closest of the
  kernels' formats to the trained weights.
- Otherwise, the target's float path for its dtype (engine/models/cpu_linear.py): packed oneDNN
  weights and the panel kernel, or bf16 panels.

A draft only proposes: the target verifies every token, so the form its weights take can change
which drafts are accepted, never the output. Norms, embeddings and the draft's KV keep the
draft's dtype. Training builds its drafts apart, as plain modules (autograd needs their weights).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from engine.models.cpu_linear import linear_path, plain_linears, prepare_linears, replace_module
from engine.models.int8_quantize import quantize_int8
from engine.models.quantized_linear import QuantizedLinear
from engine.models.quantized_model import quant_backend

if TYPE_CHECKING:
    from engine.config import QuantActivations


def prepare_draft_linears(
    drafter: nn.Module,
    device: torch.device,
    dtype: torch.dtype,
    target_quantized: bool,
    activations: QuantActivations = "float",
) -> str:
    """Replace every ``nn.Linear`` of ``drafter`` (on ``device``, in ``dtype``) by the module of the
    target's form (module docstring); returns the form's name: ``int8``, or the float path's."""
    if target_quantized:
        kernels, _ = quant_backend(device, dtype)
        if kernels is not None and device.type == "cpu":
            for name, module in plain_linears(drafter):
                weight = kernels.place(quantize_int8(module.weight))
                replace_module(drafter, name, QuantizedLinear(weight, module.bias, kernels, activations))
            return "int8"
    path = linear_path(device, dtype)
    prepare_linears(drafter, path)
    return path
