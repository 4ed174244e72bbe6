"""The EAGLE draft model (EAGLE-1/2): ``fc(concat(embed(token), feature))`` through Llama
decoder layer(s) whose first has no input norm, over a contiguous KV of its own per request.

Parameter names are transformers' and the EAGLE checkpoints' (``fc``, ``layers.{i}.self_attn.*``,
``layers.{i}.mlp.*``, the speculators layout's extra norms), so a checkpoint loads with
``load_state_dict`` (engine/spec_decode/eagle_checkpoint.py). Plain PyTorch, differentiable, so
training (eagle_training.py) runs the same modules as serving (eagle.py). :class:`DraftNetwork` is
what the proposer drives; EAGLE-3's draft (eagle3_draft.py) implements it over the same layer body
(:class:`DraftLayerBody`) and draft KV.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn
from transformers import LlamaConfig

from engine.models.ops import TorchOps
from engine.models.rotary import RotaryEmbedding


@dataclass(frozen=True, slots=True)
class EagleDraftShape:
    """The draft's numbers, read from its checkpoint's config (eagle_checkpoint.py)."""

    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    rms_norm_eps: float
    attention_bias: bool
    mlp_bias: bool
    fc_bias: bool
    # HASS/TTT variant (speculators' ``layernorms``): norms after the embedding, before the LM
    # head, and layer 0 keeps its input norm; EAGLE-1/2 have none of the three.
    layernorms: bool
    own_embedding: bool  # the checkpoint's embed_tokens (else the target's)
    own_lm_head: bool  # the checkpoint's lm_head (else the target's)

    @classmethod
    def from_layer_config(
        cls,
        config: LlamaConfig,
        num_layers: int,
        fc_bias: bool,
        layernorms: bool,
        own_embedding: bool,
        own_lm_head: bool,
    ) -> EagleDraftShape:
        num_heads = config.num_attention_heads
        return cls(
            num_layers=num_layers,
            hidden_size=config.hidden_size,
            intermediate_size=config.intermediate_size,
            num_heads=num_heads,
            num_kv_heads=getattr(config, "num_key_value_heads", None) or num_heads,
            head_dim=getattr(config, "head_dim", None) or config.hidden_size // num_heads,
            vocab_size=config.vocab_size,
            rms_norm_eps=config.rms_norm_eps,
            attention_bias=bool(getattr(config, "attention_bias", False)),
            mlp_bias=bool(getattr(config, "mlp_bias", False)),
            fc_bias=fc_bias,
            layernorms=layernorms,
            own_embedding=own_embedding,
            own_lm_head=own_lm_head,
        )


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalised in float32 and rounded before the weight, as transformers does.
        return self.weight * torch.rms_norm(x.float(), (x.shape[-1],), eps=self.eps).to(x.dtype)


@dataclass(slots=True)
class DraftKV:
    """One request's draft KV: entry ``e`` is position ``start + e``, in every layer."""

    start: int
    keys: list[torch.Tensor]  # per layer [capacity, num_kv_heads, head_dim]
    values: list[torch.Tensor]
    length: int = 0

    @property
    def end(self) -> int:
        """The position after the last entry."""
        return self.start + self.length

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store ``k, v`` ([T, H_kv, D]) after the entries held; returns the layer's keys and
        values up to them. ``length`` moves on once every layer has stored (:meth:`DraftEntries.advance`)."""
        end = self.length + k.shape[0]
        if end > self.keys[layer].shape[0]:
            capacity = max(end, 2 * self.keys[layer].shape[0])
            for cache in (self.keys, self.values):
                grown = cache[layer].new_empty(capacity, *cache[layer].shape[1:])
                grown[: self.length] = cache[layer][: self.length]
                cache[layer] = grown
        self.keys[layer][self.length : end] = k
        self.values[layer][self.length : end] = v
        return self.keys[layer][:end], self.values[layer][:end]


@dataclass(frozen=True, slots=True)
class DraftEntries:
    """Where one draft pass's entries go: ``counts[r]`` of them (in order) after ``kvs[r]``'s, for
    each request ``r``, at ``positions`` [T] (T = sum of ``counts``)."""

    positions: torch.Tensor
    kvs: Sequence[DraftKV]
    counts: Sequence[int]

    @classmethod
    def after(cls, kv: DraftKV, num_entries: int) -> DraftEntries:
        """``num_entries`` entries of one request, after those ``kv`` holds."""
        positions = torch.arange(kv.end, kv.end + num_entries, device=kv.keys[0].device)
        return cls(positions, [kv], [num_entries])

    def advance(self) -> None:
        """Count the pass's entries in, once every layer has stored them."""
        for kv, count in zip(self.kvs, self.counts):
            kv.length += count


class DraftLayerBody(nn.Module):
    """A Llama decoder layer over a :class:`DraftKV` from its attention's input on (what comes
    before, the input norm(s), is EAGLE's or EAGLE-3's: :class:`EagleLayer`,
    engine/spec_decode/eagle3_draft.py); parameter names are transformers' (and the EAGLE
    checkpoints'), so a checkpoint loads with ``load_state_dict``."""

    def __init__(self, shape: EagleDraftShape, index: int, rotary: RotaryEmbedding, attention_input_size: int) -> None:
        super().__init__()
        hidden, head_dim = shape.hidden_size, shape.head_dim
        self.index = index
        self.num_heads, self.num_kv_heads, self.head_dim = shape.num_heads, shape.num_kv_heads, head_dim
        self.self_attn = nn.Module()
        width = attention_input_size
        self.self_attn.q_proj = nn.Linear(width, shape.num_heads * head_dim, bias=shape.attention_bias)
        self.self_attn.k_proj = nn.Linear(width, shape.num_kv_heads * head_dim, bias=shape.attention_bias)
        self.self_attn.v_proj = nn.Linear(width, shape.num_kv_heads * head_dim, bias=shape.attention_bias)
        self.self_attn.o_proj = nn.Linear(shape.num_heads * head_dim, hidden, bias=shape.attention_bias)
        self.post_attention_layernorm = RMSNorm(hidden, shape.rms_norm_eps)
        self.mlp = nn.Module()
        self.mlp.gate_proj = nn.Linear(hidden, shape.intermediate_size, bias=shape.mlp_bias)
        self.mlp.up_proj = nn.Linear(hidden, shape.intermediate_size, bias=shape.mlp_bias)
        self.mlp.down_proj = nn.Linear(shape.intermediate_size, hidden, bias=shape.mlp_bias)
        self.rotary = [rotary]  # shared by the layers; a list keeps it out of the state dict

    def attend(
        self,
        attn_in: torch.Tensor,
        residual: torch.Tensor,
        entries: DraftEntries,
    ) -> torch.Tensor:
        """attn_in: [T, attention_input_size], the ``entries``; the attention's output is added to
        ``residual`` [T, hidden_size], then the MLP block. Returns [T, hidden_size]."""
        num_tokens = attn_in.shape[0]
        attn = self.self_attn
        q = attn.q_proj(attn_in).view(num_tokens, self.num_heads, self.head_dim)
        k = attn.k_proj(attn_in).view(num_tokens, self.num_kv_heads, self.head_dim)
        v = attn.v_proj(attn_in).view(num_tokens, self.num_kv_heads, self.head_dim)
        rotary = self.rotary[0]
        positions = entries.positions
        cos, sin = rotary.cos[positions].unsqueeze(1), rotary.sin[positions].unsqueeze(1)  # [T, 1, D/2]
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        # Each request attends over its own cache: one small attention per request.
        outs = []
        first = 0
        for kv, count in zip(entries.kvs, entries.counts):
            rows = slice(first, first + count)
            keys, values = kv.append(self.index, k[rows], v[rows])  # [L, H_kv, D], the new entries last
            outs.append(_causal_attention(q[rows], keys, values))
            first += count
        out = outs[0] if len(outs) == 1 else torch.cat(outs)
        hidden = residual + attn.o_proj(out.reshape(num_tokens, -1))
        mlp_in = self.post_attention_layernorm(hidden)
        return hidden + self.mlp.down_proj(F.silu(self.mlp.gate_proj(mlp_in)) * self.mlp.up_proj(mlp_in))


class EagleLayer(DraftLayerBody):
    """EAGLE-1/2's decoder layer: a Llama one over fc's output (its first without an input norm)."""

    def __init__(self, shape: EagleDraftShape, index: int, rotary: RotaryEmbedding) -> None:
        super().__init__(shape, index, rotary, shape.hidden_size)
        # EAGLE's first layer reads fc's output as it is (its input norm removed).
        self.input_layernorm = RMSNorm(shape.hidden_size, shape.rms_norm_eps) if index > 0 or shape.layernorms else None

    def forward(self, hidden: torch.Tensor, entries: DraftEntries) -> torch.Tensor:
        """hidden: [T, hidden_size], the ``entries``' (:meth:`attend`)."""
        attn_in = hidden if self.input_layernorm is None else self.input_layernorm(hidden)
        return self.attend(attn_in, hidden, entries)


def _causal_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """q: [T, H, D], the last T of the L entries of keys, values: [L, H_kv, D]; each new entry
    sees every earlier entry and itself. Returns [T, H, D]."""
    num_tokens, num_keys = q.shape[0], keys.shape[0]
    visible = torch.arange(num_keys, device=q.device)[None, :] <= (
        torch.arange(num_tokens, device=q.device)[:, None] + num_keys - num_tokens
    )
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1), keys.transpose(0, 1), values.transpose(0, 1), attn_mask=visible, enable_gqa=True
    )  # [H, T, D]
    return out.transpose(0, 1)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Neox-style rotation of x: [T, heads, D] (the engine's ops write into buffers, which
    autograd refuses; training goes through here too)."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


class DraftNetwork(Protocol):
    """What :class:`~engine.spec_decode.eagle.EagleProposer` drives: EAGLE-1/2's
    :class:`EagleDraft` or EAGLE-3's (engine/spec_decode/eagle3_draft.py). They differ in the
    target features they read, how they take them in, and the vocabulary they draft in."""

    shape: EagleDraftShape  # the draft layers' numbers (its KV's shape: :func:`new_draft_kv`)
    embed_tokens: nn.Embedding | None  # None: the target's embedding

    @property
    def dtype(self) -> torch.dtype:
        """Its activations' and KV's dtype (not its linear layers' weights': those take the
        target's form, engine/spec_decode/draft_linears.py)."""
        ...

    @property
    def device(self) -> torch.device: ...

    @property
    def target_hidden_size(self) -> int:
        """The width of one target hidden state the draft reads."""
        ...

    @property
    def feature_layer_ids(self) -> tuple[int, ...] | None:
        """None: the target's feature is its final normed hidden state (EAGLE-1/2); else the
        target layers whose input (the residual stream) is concatenated, in ascending order."""
        ...

    def fuse(self, features: torch.Tensor) -> torch.Tensor:
        """The target's features [T, width] as :meth:`__call__` reads them in place of its own
        outputs."""
        ...

    def __call__(self, embeds: torch.Tensor, hidden: torch.Tensor, entries: DraftEntries) -> torch.Tensor:
        """The ``entries``' outputs [T, hidden_size] from token ``i + 1``'s embedding and
        :meth:`fuse`'s result (or the draft's own previous output) for ``i``; stores them in the
        entries' draft KVs."""
        ...

    def draft_token_ids(
        self, outputs: torch.Tensor, target_lm_head: Callable[[torch.Tensor], torch.Tensor]
    ) -> torch.Tensor:
        """The top-1 guess [R] after each output [R, hidden_size], as the target's token ids."""
        ...


class EagleDraft(nn.Module):
    """``fc(concat(embed(token), feature))`` through the layers; the LM head outside (its own or
    the target's, :meth:`logits`)."""

    feature_layer_ids: tuple[int, ...] | None = None  # the target's final normed hidden state

    def __init__(self, shape: EagleDraftShape, max_positions: int, layer_config: LlamaConfig, dtype: torch.dtype):
        super().__init__()
        self.shape = shape
        hidden = shape.hidden_size
        rotary = RotaryEmbedding(layer_config, shape.head_dim, max_positions, dtype, TorchOps())
        self.fc = nn.Linear(2 * hidden, hidden, bias=shape.fc_bias)
        self.layers = nn.ModuleList(EagleLayer(shape, index, rotary) for index in range(shape.num_layers))
        self.embed_tokens = nn.Embedding(shape.vocab_size, hidden) if shape.own_embedding else None
        self.lm_head = nn.Linear(hidden, shape.vocab_size, bias=False) if shape.own_lm_head else None
        self.post_embedding_layernorm = RMSNorm(hidden, shape.rms_norm_eps) if shape.layernorms else None
        self.pre_lm_head_layernorm = RMSNorm(hidden, shape.rms_norm_eps) if shape.layernorms else None
        self.rotary = rotary
        self.layer_config = layer_config  # written back with the draft (eagle_checkpoint.py)

    def forward(self, embeds: torch.Tensor, features: torch.Tensor, entries: DraftEntries) -> torch.Tensor:
        """embeds, features: [T, hidden_size] (token ``i + 1``'s embedding, the feature of ``i``)
        of the ``entries``, which it stores. Returns the outputs [T, hidden_size]."""
        if self.post_embedding_layernorm is not None:
            embeds = self.post_embedding_layernorm(embeds)
        hidden = self.fc(torch.cat([embeds, features.to(embeds.dtype)], dim=-1))
        for layer in self.layers:
            hidden = layer(hidden, entries)
        entries.advance()
        return hidden

    def logits(self, outputs: torch.Tensor, target_lm_head: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        if self.pre_lm_head_layernorm is not None:
            outputs = self.pre_lm_head_layernorm(outputs)
        return (self.lm_head if self.lm_head is not None else target_lm_head)(outputs)

    @property
    def target_hidden_size(self) -> int:
        return self.shape.hidden_size

    @property
    def dtype(self) -> torch.dtype:
        return self.layers[0].post_attention_layernorm.weight.dtype  # a norm's: never quantized

    @property
    def device(self) -> torch.device:
        return self.layers[0].post_attention_layernorm.weight.device

    def fuse(self, features: torch.Tensor) -> torch.Tensor:
        return features  # fc takes the feature in beside the embedding, as it takes the draft's own outputs

    def draft_token_ids(
        self, outputs: torch.Tensor, target_lm_head: Callable[[torch.Tensor], torch.Tensor]
    ) -> torch.Tensor:
        return self.logits(outputs, target_lm_head).argmax(-1)


def new_draft_kv(draft: DraftNetwork, start: int, capacity: int = 16) -> DraftKV:
    """An empty draft KV whose first entry will be position ``start`` (it grows as it fills)."""
    shape = draft.shape
    empty = [
        torch.empty(capacity, shape.num_kv_heads, shape.head_dim, dtype=draft.dtype, device=draft.device)
        for _ in range(2 * shape.num_layers)
    ]
    return DraftKV(start, empty[: shape.num_layers], empty[shape.num_layers :])
