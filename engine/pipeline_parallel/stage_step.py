"""One pipeline stage's part of a step, the same in every stage's process.

Every stage has the step's flat batch (token ids, positions, attention metadata: the engine
sends it to every rank). In call order, for a model split into stages 0..N-1:

1. Stage 0 embeds the tokens and runs its layers; every stage after it first waits for its
   predecessor's hidden states and residual (engine/pipeline_parallel/activation_channel.py).
2. A stage writes its layers' K and V into its own KV cache (the same block ids on every
   rank: the engine's block table is one for all) and runs its layers.
3. A stage before the last hands its output to the next one and is done with the step; the
   last one (the engine's own process, with its tensor-parallel peers) computes the logits,
   and the engine samples.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from engine.flat_batch import FlatBatch
from engine.models.llama import LlamaFamilyForCausalLM
from engine.pipeline_parallel.activation_channel import ActivationReceiver, ActivationSender


@torch.inference_mode()
def run_stage(
    model: LlamaFamilyForCausalLM,
    batch: FlatBatch,
    layer_caches: Sequence[torch.Tensor],
    inbound: ActivationReceiver | None,
    outbound: ActivationSender | None,
) -> torch.Tensor | None:
    """This stage's part of the step: the float32 logits on the last stage (``outbound``
    None), None on the others. ``inbound`` None: the first stage, which embeds the tokens."""
    if inbound is None:
        hidden, residual = model.embed_tokens(batch.input_ids), None
    else:
        hidden, residual = inbound.receive(batch.input_ids.shape[0], batch.input_ids.device)
    hidden, residual = model.run_layers(batch.positions, hidden, residual, layer_caches, batch.metadata)
    if outbound is not None:
        outbound.send(hidden, residual)
        return None
    return model.compute_logits(hidden, residual, batch.logits_indices)
