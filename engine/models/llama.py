"""Llama-family decoder (Llama 2/3, Mistral, Qwen2) over a paged KV cache.

The batch is flat: ``T`` tokens from many sequences laid end to end, with the
attention backend told where each sequence starts (``AttentionMetadata``).
Q/K/V and gate/up projections are fused into single matmuls at load time.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch
from torch import nn
from transformers import PretrainedConfig

from engine.attention.backend import AttentionBackend
from engine.attention.metadata import AttentionMetadata
from engine.models.ops import ModelOps
from engine.models.rotary import RotaryEmbedding


@dataclass(frozen=True, slots=True)
class ModelShape:
    """The numbers of a checkpoint that the KV cache, the attention and the fingerprint depend on."""

    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    rms_norm_eps: float
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    tie_word_embeddings: bool

    @classmethod
    def from_config(cls, config: PretrainedConfig, architecture: str) -> ModelShape:
        if getattr(config, "hidden_act", "silu") != "silu":
            raise ValueError(f"only the silu MLP activation is supported, the checkpoint uses {config.hidden_act!r}")
        attention_bias = bool(getattr(config, "attention_bias", False))
        num_heads = config.num_attention_heads
        return cls(
            num_layers=config.num_hidden_layers,
            hidden_size=config.hidden_size,
            intermediate_size=config.intermediate_size,
            num_heads=num_heads,
            num_kv_heads=getattr(config, "num_key_value_heads", None) or num_heads,
            head_dim=getattr(config, "head_dim", None) or config.hidden_size // num_heads,
            vocab_size=config.vocab_size,
            rms_norm_eps=config.rms_norm_eps,
            # Qwen2 always has q/k/v biases and no output bias; Llama says so in its config.
            qkv_bias=architecture == "Qwen2ForCausalLM" or attention_bias,
            o_bias=architecture != "Qwen2ForCausalLM" and attention_bias,
            mlp_bias=bool(getattr(config, "mlp_bias", False)),
            tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
        )


class RMSNorm(nn.Module):
    """RMSNorm fused with the residual add before it (``ModelOps.add_rms_norm``)."""

    def __init__(self, hidden_size: int, eps: float, ops: ModelOps) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps
        self.ops = ops

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        return self.ops.add_rms_norm(x, residual, self.weight, self.eps)


class DecoderLayer(nn.Module):
    def __init__(self, shape: ModelShape, rotary: RotaryEmbedding, backend: AttentionBackend, ops: ModelOps) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = shape.num_heads, shape.num_kv_heads, shape.head_dim
        self.q_size, self.kv_size = shape.num_heads * shape.head_dim, shape.num_kv_heads * shape.head_dim
        self.scale = shape.head_dim**-0.5
        self.input_layernorm = RMSNorm(shape.hidden_size, shape.rms_norm_eps, ops)
        self.qkv_proj = nn.Linear(shape.hidden_size, self.q_size + 2 * self.kv_size, bias=shape.qkv_bias)
        self.o_proj = nn.Linear(self.q_size, shape.hidden_size, bias=shape.o_bias)
        self.post_attention_layernorm = RMSNorm(shape.hidden_size, shape.rms_norm_eps, ops)
        self.gate_up_proj = nn.Linear(shape.hidden_size, 2 * shape.intermediate_size, bias=shape.mlp_bias)
        self.down_proj = nn.Linear(shape.intermediate_size, shape.hidden_size, bias=shape.mlp_bias)
        self.rotary = rotary
        self.backend = backend
        self.ops = ops

    def forward(
        self,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        layer_cache: torch.Tensor,
        metadata: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden: [T, hidden_size], this layer's input before the residual add (residual is None
        for the first layer). Returns (output, residual) with the same convention."""
        num_tokens = hidden.shape[0]
        hidden, residual = self.input_layernorm(hidden, residual)
        qkv = self.qkv_proj(hidden)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        # Rotation writes fresh contiguous q [T, H, D] and k [T, H_kv, D], as the backends prefer.
        q, k = self.rotary(
            q.view(num_tokens, self.num_heads, self.head_dim),
            k.view(num_tokens, self.num_kv_heads, self.head_dim),
            positions,
        )
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        attn = self.backend.forward(q, k, v, layer_cache, metadata, self.scale)  # [T, H, D]
        hidden, residual = self.post_attention_layernorm(self.o_proj(attn.reshape(num_tokens, self.q_size)), residual)
        return self.down_proj(self.ops.silu_and_mul(self.gate_up_proj(hidden))), residual


class LlamaFamilyForCausalLM(nn.Module):
    """One implementation for LlamaForCausalLM, MistralForCausalLM and Qwen2ForCausalLM."""

    def __init__(
        self,
        config: PretrainedConfig,
        architecture: str,
        max_positions: int,
        dtype: torch.dtype,
        backend: AttentionBackend,
        ops: ModelOps,
    ) -> None:
        super().__init__()
        self.shape = ModelShape.from_config(config, architecture)
        shape = self.shape
        self.rotary = RotaryEmbedding(config, shape.head_dim, max_positions, dtype, ops)
        self.embed_tokens = nn.Embedding(shape.vocab_size, shape.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(shape, self.rotary, backend, ops) for _ in range(shape.num_layers))
        self.norm = RMSNorm(shape.hidden_size, shape.rms_norm_eps, ops)
        self.lm_head = nn.Linear(shape.hidden_size, shape.vocab_size, bias=False)
        if shape.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        layer_caches: Sequence[torch.Tensor],
        metadata: AttentionMetadata,
        logits_indices: torch.Tensor,
    ) -> torch.Tensor:
        """input_ids, positions: [T]; layer_caches: per layer, [2, num_blocks, block_size, H_kv, D]
        (views of the block-major cache, engine/kv_cache_layout.py);
        logits_indices: [R] rows of the batch whose next-token logits are needed.
        Returns float32 logits [R, vocab_size]."""
        hidden, residual = self.embed_tokens(input_ids), None
        for layer_index, layer in enumerate(self.layers):
            hidden, residual = layer(positions, hidden, residual, layer_caches[layer_index], metadata)
        hidden, _ = self.norm(hidden[logits_indices], residual[logits_indices])
        return self.lm_head(hidden).float()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy Hugging Face checkpoint tensors into the fused parameters."""
        shape = self.shape
        q, kv, inter = shape.num_heads * shape.head_dim, shape.num_kv_heads * shape.head_dim, shape.intermediate_size
        # HF projection name -> (our parameter name, row offset, rows)
        fused = {
            "self_attn.q_proj": ("qkv_proj", 0, q),
            "self_attn.k_proj": ("qkv_proj", q, kv),
            "self_attn.v_proj": ("qkv_proj", q + kv, kv),
            "self_attn.o_proj": ("o_proj", None, None),
            "mlp.gate_proj": ("gate_up_proj", 0, inter),
            "mlp.up_proj": ("gate_up_proj", inter, inter),
            "mlp.down_proj": ("down_proj", None, None),
        }
        params = dict(self.named_parameters())
        rows_loaded: Counter[str] = Counter()
        for name, tensor in weights:
            if name.startswith("lm_head.") and self.shape.tie_word_embeddings:
                continue  # tied: some checkpoints still store the copy
            target, offset, rows = _map_name(name, fused)
            if target not in params:
                if "rotary_emb" in name:
                    continue
                raise ValueError(f"checkpoint tensor {name!r} has no place in the model")
            param = params[target]
            dest = param.data if offset is None else param.data[offset : offset + rows]
            if rows_loaded[target] + dest.shape[0] > param.shape[0]:
                raise ValueError(f"checkpoint tensor {name!r} appears more than once")
            if dest.shape != tensor.shape:
                raise ValueError(
                    f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, expected {tuple(dest.shape)}"
                )
            dest.copy_(tensor)
            rows_loaded[target] += dest.shape[0]
        missing = [name for name, param in params.items() if rows_loaded[name] != param.shape[0]]
        if missing:
            raise ValueError(f"checkpoint is missing tensors for {missing[:5]}{'...' if len(missing) > 5 else ''}")


def _map_name(name: str, fused: dict[str, tuple[str, int | None, int | None]]) -> tuple[str, int | None, int | None]:
    """``model.layers.3.self_attn.k_proj.weight`` -> (``layers.3.qkv_proj.weight``, offset, rows)."""
    name = name.removeprefix("model.")
    if name.startswith("layers."):
        _, index, rest = name.split(".", 2)
        for hf_name, (ours, offset, rows) in fused.items():
            if rest.startswith(hf_name + "."):
                return f"layers.{index}.{ours}{rest[len(hf_name) :]}", offset, rows
        return f"layers.{index}.{rest}", None, None
    return name, None, None
