"""``--quantization int8`` (vLLM's flag name): a float checkpoint's weights quantized at load time
to int8, per output channel and symmetric, weight-only.

Every 2-D weight of the checkpoint (the linear layers, the embedding and an untied LM head)
becomes an INT8 :class:`QuantizedWeight` (engine/models/quant_format.py): each row ``r`` its
scale ``s_r = max|w_r| / 127`` and ``q = round(w / s_r)`` (to nearest even, within +-127), so
``w ~ s_r * q`` with an error of at most ``s_r / 2`` per element. The norms stay float. The
tensors are quantized one at a time as they stream from the safetensors files, so a float copy
of the whole model never exists, and they load through engine/models/quantized_model.py like a
GGUF file's: the same kernels (float activations by default, Q8_0 activations with
``--quant-activations q8``, engine/models/quantized_linear.py), one byte per weight
plus four per row. A row, being an output channel, keeps its scale under every tensor-parallel
split, so a rank's columns compute what the whole row would.

``--dtype`` keeps meaning the compute dtype: activations, the norms and the KV cache.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

from engine.models.quant_format import QUANT_FORMATS, QuantizedWeight
from engine.models.quantized_model import Payload

INT8 = QUANT_FORMATS["INT8"]


def quantize_int8(weight: torch.Tensor) -> QuantizedWeight:
    """``weight`` [out, in], any float dtype -> INT8 rows (an all-zero row gets scale 0)."""
    values = weight.detach().float()
    scale = values.abs().amax(dim=1, keepdim=True) / 127.0  # [out, 1]
    q = torch.round(values / torch.where(scale > 0, scale, 1.0)).clamp(-127, 127).to(torch.int8)
    data = torch.cat([scale.view(torch.uint8), q.view(torch.uint8)], dim=1)
    return QuantizedWeight(INT8, data, values.shape[1])


def int8_weights(tensors: Iterable[tuple[str, torch.Tensor]], tied: bool) -> Iterator[tuple[str, Payload]]:
    """A checkpoint's tensors with every 2-D one quantized; a tied checkpoint's stored copy of the
    LM head is passed over unquantized (the loader skips it: the head is the embedding)."""
    for name, tensor in tensors:
        if tensor.dim() != 2 or (tied and name.startswith("lm_head.")):
            yield name, tensor
        else:
            yield name, quantize_int8(tensor)
