"""The EAGLE-3 draft model: the target's low, middle and high hidden states fused by ``fc``, read
beside the token's embedding by one decoder layer, over a vocabulary of its own.

Entry ``i`` of the draft reads token ``i + 1``'s embedding and a hidden state ``h``: for an entry
the target computed, ``h = fc(concat(a_i))`` of the residual streams ``a_i`` entering the target
layers :attr:`Eagle3Draft.feature_layer_ids` at position ``i``; for a chain's entry, the draft's own
previous (pre-norm) output. The layer attends over ``concat(input_layernorm(embed),
hidden_norm(h))`` (``2 * hidden_size`` wide) and adds its attention to ``h`` (or, with
``norm_before_residual``, to ``hidden_norm(h)``), then its MLP; ``lm_head(norm(output))`` gives
logits over the draft vocabulary, whose token ``d`` is the target's ``d + d2t[d]``.

Parameter names are the speculators package's (``layers.0.*``; EAGLE's reference checkpoints say
``midlayer.*``, renamed on load: engine/spec_decode/eagle3_checkpoint.py). The draft KV and the
attention are EAGLE-1's (eagle_draft.py), and so is the proposer that drives it (eagle.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from transformers import LlamaConfig

from engine.models.ops import TorchOps
from engine.models.rotary import RotaryEmbedding
from engine.spec_decode.eagle_draft import DraftEntries, DraftLayerBody, EagleDraftShape, RMSNorm


@dataclass(frozen=True, slots=True)
class Eagle3Shape:
    """What EAGLE-3 adds to the layer's numbers (:class:`EagleDraftShape`, whose ``vocab_size``
    is the target's: the embedding's rows)."""

    draft_vocab_size: int
    target_hidden_size: int
    feature_layer_ids: tuple[int, ...]  # ascending target layer indices (vLLM's eagle_aux_hidden_state_layer_ids)
    norm_before_residual: bool  # the residual is hidden_norm(h), not h (speculators' option)


class Eagle3Layer(DraftLayerBody):
    """EAGLE-3's decoder layer (module docstring): its attention reads the normed embedding and
    the normed hidden state side by side."""

    def __init__(self, shape: EagleDraftShape, rotary: RotaryEmbedding, norm_before_residual: bool) -> None:
        super().__init__(shape, 0, rotary, 2 * shape.hidden_size)
        self.input_layernorm = RMSNorm(shape.hidden_size, shape.rms_norm_eps)  # on the embedding
        self.hidden_norm = RMSNorm(shape.hidden_size, shape.rms_norm_eps)
        self.norm_before_residual = norm_before_residual

    def forward(self, embeds: torch.Tensor, hidden: torch.Tensor, entries: DraftEntries) -> torch.Tensor:
        normed = self.hidden_norm(hidden)
        attn_in = torch.cat([self.input_layernorm(embeds), normed], dim=-1)
        return self.attend(attn_in, normed if self.norm_before_residual else hidden, entries)


class Eagle3Draft(nn.Module):
    """One EAGLE-3 layer between ``fc`` and its own norm and LM head (module docstring); drives
    as :class:`~engine.spec_decode.eagle_draft.DraftNetwork`."""

    d2t: torch.Tensor  # [draft_vocab_size] int64, a buffer

    def __init__(
        self,
        shape: EagleDraftShape,
        eagle3: Eagle3Shape,
        max_positions: int,
        layer_config: LlamaConfig,
        dtype: torch.dtype,
    ) -> None:
        super().__init__()
        if shape.num_layers != 1:
            raise ValueError(f"EAGLE-3 drafts of one decoder layer are served here, not {shape.num_layers}")
        self.shape = shape
        self.eagle3 = eagle3
        hidden = shape.hidden_size
        rotary = RotaryEmbedding(layer_config, shape.head_dim, max_positions, dtype, TorchOps())
        self.fc = nn.Linear(len(eagle3.feature_layer_ids) * eagle3.target_hidden_size, hidden, bias=False)
        self.layers = nn.ModuleList([Eagle3Layer(shape, rotary, eagle3.norm_before_residual)])
        self.norm = RMSNorm(hidden, shape.rms_norm_eps)
        self.lm_head = nn.Linear(hidden, eagle3.draft_vocab_size, bias=False)
        self.embed_tokens = nn.Embedding(shape.vocab_size, hidden) if shape.own_embedding else None
        # Draft token d is the target's d + d2t[d] (a buffer: it moves with the draft, never trains).
        self.register_buffer("d2t", torch.zeros(eagle3.draft_vocab_size, dtype=torch.int64))
        self.rotary = rotary
        self.layer_config = layer_config  # written back with the draft (eagle3_checkpoint.py)

    @property
    def target_hidden_size(self) -> int:
        return self.eagle3.target_hidden_size

    @property
    def feature_layer_ids(self) -> tuple[int, ...]:
        return self.eagle3.feature_layer_ids

    @property
    def dtype(self) -> torch.dtype:
        return self.norm.weight.dtype  # a norm's: never quantized (engine/spec_decode/draft_linears.py)

    @property
    def device(self) -> torch.device:
        return self.norm.weight.device

    def fuse(self, features: torch.Tensor) -> torch.Tensor:
        """features: [T, len(feature_layer_ids) * target_hidden_size] -> [T, hidden_size]."""
        return self.fc(features.to(self.dtype))

    def forward(self, embeds: torch.Tensor, hidden: torch.Tensor, entries: DraftEntries) -> torch.Tensor:
        """embeds, hidden: [T, hidden_size] of the ``entries``, which it stores. Returns the
        pre-norm outputs [T, hidden_size] (a chain reads them back as ``hidden``)."""
        outputs = self.layers[0](embeds.to(hidden.dtype), hidden, entries)
        entries.advance()
        return outputs

    def logits(self, outputs: torch.Tensor) -> torch.Tensor:
        """Logits over the draft vocabulary [R, draft_vocab_size]."""
        return self.lm_head(self.norm(outputs))

    def draft_token_ids(
        self, outputs: torch.Tensor, target_lm_head: Callable[[torch.Tensor], torch.Tensor]
    ) -> torch.Tensor:
        """The target's ids of the top-1 draft tokens (``target_lm_head`` is unused: EAGLE-3 drafts
        with its own head)."""
        draft_ids = self.logits(outputs).argmax(-1)
        return draft_ids + self.d2t[draft_ids]
