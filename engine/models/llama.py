"""Llama-family decoder (Llama 2/3, Mistral, Qwen2) over a paged KV cache.

The batch is flat: ``T`` tokens from many sequences laid end to end, with the
attention backend told where each sequence starts (``AttentionMetadata``).
Q/K/V and gate/up projections are fused into single matmuls at load time.

Under tensor parallelism each rank builds this model with its shard of every weight
(engine/tensor_parallel/layout.py: its heads, its slice of the MLP and of the vocabulary)
and all-reduces the row-parallel outputs (o_proj, down_proj) and gathers the LM head's
vocabulary shards; without it the model is whole and no collective runs.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn
from transformers import PretrainedConfig

from engine.attention.backend import AttentionBackend
from engine.attention.metadata import AttentionMetadata
from engine.models.ops import ModelOps
from engine.models.rotary import RotaryEmbedding
from engine.pipeline_parallel.stages import PipelineStage
from engine.tensor_parallel.group import TensorParallelGroup
from engine.tensor_parallel.layout import TensorParallelLayout


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


@dataclass(frozen=True, slots=True)
class TensorParallel:
    """This rank's shard (``layout``) and the collectives that join the shards (``group``)."""

    layout: TensorParallelLayout
    group: TensorParallelGroup


@dataclass(frozen=True, slots=True)
class ShardSlice:
    """The part of a checkpoint tensor one rank holds: ``count`` rows (``dim`` 0, output
    features) or columns (``dim`` 1, input features) from ``start``, then ``padding`` zero rows
    (the LM head's last vocabulary shard)."""

    dim: Literal[0, 1]
    start: int
    count: int
    padding: int = 0


# A rank holds a slice of a tensor, all of it (replicated, or no tensor parallelism), or none.
Shard = ShardSlice | Literal["whole", "none"]


@dataclass(frozen=True, slots=True)
class LocalShape:
    """What this process holds of the model: all of it, or one rank's shard."""

    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    vocab_size: int  # LM-head rows, padding included
    bias_rank: bool  # adds the row-parallel projections' biases (rank 0; every rank sums them once)

    @classmethod
    def of(cls, shape: ModelShape, layout: TensorParallelLayout | None) -> LocalShape:
        if layout is None:
            return cls(shape.num_heads, shape.num_kv_heads, shape.intermediate_size, shape.vocab_size, True)
        return cls(
            layout.num_local_heads,
            layout.num_local_kv_heads,
            layout.local_intermediate_size,
            layout.local_vocab_size,
            layout.rank == 0,
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
    def __init__(
        self,
        shape: ModelShape,
        local: LocalShape,
        rotary: RotaryEmbedding,
        backend: AttentionBackend,
        ops: ModelOps,
        group: TensorParallelGroup | None,
    ) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = local.num_heads, local.num_kv_heads, shape.head_dim
        self.q_size, self.kv_size = local.num_heads * shape.head_dim, local.num_kv_heads * shape.head_dim
        self.scale = shape.head_dim**-0.5
        self.input_layernorm = RMSNorm(shape.hidden_size, shape.rms_norm_eps, ops)
        # Column-parallel (a shard of the output features): q, k, v, gate, up.
        self.qkv_proj = nn.Linear(shape.hidden_size, self.q_size + 2 * self.kv_size, bias=shape.qkv_bias)
        # Row-parallel (a shard of the input features): their partial sums are all-reduced.
        self.o_proj = nn.Linear(self.q_size, shape.hidden_size, bias=shape.o_bias and local.bias_rank)
        self.post_attention_layernorm = RMSNorm(shape.hidden_size, shape.rms_norm_eps, ops)
        self.gate_up_proj = nn.Linear(shape.hidden_size, 2 * local.intermediate_size, bias=shape.mlp_bias)
        self.down_proj = nn.Linear(local.intermediate_size, shape.hidden_size, bias=shape.mlp_bias and local.bias_rank)
        self.rotary = rotary
        self.backend = backend
        self.ops = ops
        self.group = group

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
        attn_out = self._reduce(self.o_proj(attn.reshape(num_tokens, self.q_size)))
        hidden, residual = self.post_attention_layernorm(attn_out, residual)
        return self._reduce(self.down_proj(self.ops.silu_and_mul(self.gate_up_proj(hidden)))), residual

    def _reduce(self, partial: torch.Tensor) -> torch.Tensor:
        """A row-parallel projection's output: this rank's partial sum, summed over the ranks."""
        return partial if self.group is None else self.group.all_reduce(partial)


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
        parallel: TensorParallel | None = None,
        stage: PipelineStage | None = None,
    ) -> None:
        """``parallel``: build this rank's shard (None: the whole model, in this process).
        ``stage``: build this pipeline stage's layers only (None: every layer)."""
        super().__init__()
        self.shape = ModelShape.from_config(config, architecture)
        shape = self.shape
        self.layout = parallel.layout if parallel is not None else None
        self.group = parallel.group if parallel is not None else None
        self.local = LocalShape.of(shape, self.layout)
        self.stage = stage if stage is not None else PipelineStage.whole(shape.num_layers)
        self.rotary = RotaryEmbedding(config, shape.head_dim, max_positions, dtype, ops)
        # Replicated on every tensor-parallel rank. A pipeline stage other than the first holds
        # no embedding rows, one other than the last no LM-head rows (engine/pipeline_parallel/).
        self.embed_tokens = nn.Embedding(shape.vocab_size if self.stage.is_first else 0, shape.hidden_size)
        self.layers = nn.ModuleList(
            DecoderLayer(shape, self.local, self.rotary, backend, ops, self.group) for _ in self.stage.layers
        )
        self.norm = RMSNorm(shape.hidden_size, shape.rms_norm_eps, ops)
        self.lm_head = nn.Linear(shape.hidden_size, self.local.vocab_size if self.stage.is_last else 0, bias=False)
        if shape.tie_word_embeddings and self.layout is None and self.stage.is_whole:
            self.lm_head.weight = self.embed_tokens.weight

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        layer_caches: Sequence[torch.Tensor],
        metadata: AttentionMetadata,
        logits_indices: torch.Tensor,
        final_hidden_out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """input_ids, positions: [T]; layer_caches: per layer, [2, num_blocks, block_size, H_kv, D]
        (views of the block-major cache, engine/kv_cache_layout.py);
        logits_indices: [R] rows of the batch whose next-token logits are needed;
        final_hidden_out: [R, hidden_size], if given, receives those rows' final (normed) hidden
        states, which Medusa heads draft from (engine/spec_decode/medusa.py).
        Returns float32 logits [R, vocab_size]."""
        hidden, residual = self.run_layers(positions, self.embed_tokens(input_ids), None, layer_caches, metadata)
        return self.compute_logits(hidden, residual, logits_indices, final_hidden_out)

    def run_layers(
        self,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        layer_caches: Sequence[torch.Tensor],
        metadata: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """This process's layers (all, or a pipeline stage's: engine/pipeline_parallel/stage_step.py),
        ``layer_caches`` theirs in order. hidden, residual: [T, hidden_size] as a layer takes them
        (residual None before the model's first layer); returns them after the last."""
        for layer_index, layer in enumerate(self.layers):
            hidden, residual = layer(positions, hidden, residual, layer_caches[layer_index], metadata)
        if residual is None:
            raise RuntimeError("bug: a model or pipeline stage without layers")
        return hidden, residual

    def run_layers_capturing(
        self,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        layer_caches: Sequence[torch.Tensor],
        metadata: AttentionMetadata,
        layer_ids: Sequence[int],
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """:meth:`run_layers` over the whole model from the embeddings ``hidden``, and the residual
        stream entering each layer of ``layer_ids`` (ascending; 0 is the embeddings), concatenated
        [T, len(layer_ids) * hidden_size]: the hidden states EAGLE-3 drafts fuse, as vLLM's
        ``eagle_aux_hidden_state_layer_ids`` name them. A method of its own, so that run_layers
        pays nothing when no draft reads them."""
        captured: list[torch.Tensor] = []
        residual: torch.Tensor | None = None
        for layer_index, layer in enumerate(self.layers):
            if layer_index in layer_ids:
                # A copy of the embeddings: the next layers may add to them in place as their residual.
                captured.append(hidden.clone() if residual is None else hidden + residual)
            hidden, residual = layer(positions, hidden, residual, layer_caches[layer_index], metadata)
        if residual is None or len(captured) != len(layer_ids):
            raise RuntimeError(f"bug: layers {list(layer_ids)} captured from a model of {len(self.layers)}")
        return hidden, residual, torch.cat(captured, dim=-1)

    def compute_logits(
        self,
        hidden: torch.Tensor,
        residual: torch.Tensor,
        logits_indices: torch.Tensor,
        final_hidden_out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Float32 logits [R, vocab_size] of rows ``logits_indices`` of the last layer's output."""
        hidden, _ = self.norm(hidden[logits_indices], residual[logits_indices])
        if final_hidden_out is not None:
            final_hidden_out.copy_(hidden)
        logits = self.lm_head(hidden).float()
        if self.group is None:
            return logits
        # Every rank's vocabulary shard, side by side; the last shard's padding rows cut off.
        return self.group.all_gather_last_dim(logits)[:, : self.shape.vocab_size]

    def fused_projections(self) -> dict[str, tuple[str, int | None, int | None]]:
        """HF projection name -> (our module, row offset, rows): where each projection's rows go
        in the fused ones (offset None: the projection is the whole module)."""
        shape, local = self.shape, self.local
        q, kv, inter = local.num_heads * shape.head_dim, local.num_kv_heads * shape.head_dim, local.intermediate_size
        return {
            "self_attn.q_proj": ("qkv_proj", 0, q),
            "self_attn.k_proj": ("qkv_proj", q, kv),
            "self_attn.v_proj": ("qkv_proj", q + kv, kv),
            "self_attn.o_proj": ("o_proj", None, None),
            "mlp.gate_proj": ("gate_up_proj", 0, inter),
            "mlp.up_proj": ("gate_up_proj", inter, inter),
            "mlp.down_proj": ("down_proj", None, None),
        }

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy Hugging Face checkpoint tensors (this rank's shard of each) into the fused parameters."""
        shape = self.shape
        fused = self.fused_projections()
        params = dict(self.named_parameters())
        rows_loaded: Counter[str] = Counter()
        for name, full in weights:
            if name.startswith("lm_head.") and shape.tie_word_embeddings:
                continue  # tied: some checkpoints still store the copy
            loads = [(name, full)]
            separate_head = self.layout is not None or not self.stage.is_whole
            if separate_head and shape.tie_word_embeddings and name.endswith("embed_tokens.weight"):
                loads.append(("lm_head.weight", full))  # a copy or shard of its own: the embedding stays whole
            for load_name, load_full in loads:
                tensor = self._shard(load_name, load_full)
                if tensor is None:
                    continue  # not this rank's (a row-parallel bias on a rank other than 0)
                target, offset, rows = map_name(load_name, fused, self.stage.layers.start)
                if target not in params:
                    if "rotary_emb" in load_name:
                        continue
                    raise ValueError(f"checkpoint tensor {load_name!r} has no place in the model")
                param = params[target]
                dest = param.data if offset is None else param.data[offset : offset + rows]
                if rows_loaded[target] + dest.shape[0] > param.shape[0]:
                    raise ValueError(f"checkpoint tensor {load_name!r} appears more than once")
                if dest.shape != tensor.shape:
                    raise ValueError(
                        f"checkpoint tensor {load_name!r} has shape {tuple(tensor.shape)}, expected {tuple(dest.shape)}"
                    )
                dest.copy_(tensor)
                rows_loaded[target] += dest.shape[0]
        missing = [name for name, param in params.items() if rows_loaded[name] != param.shape[0]]
        if missing:
            raise ValueError(f"checkpoint is missing tensors for {missing[:5]}{'...' if len(missing) > 5 else ''}")

    def _shard(self, name: str, tensor: torch.Tensor) -> torch.Tensor | None:
        """This rank's part of checkpoint tensor ``name`` (all of it without tensor parallelism);
        None when the rank holds none of it."""
        shard = self.shard_of(name, tensor.shape[0])
        if not isinstance(shard, ShardSlice):
            return tensor if shard == "whole" else None
        part = tensor.narrow(shard.dim, shard.start, shard.count)
        return torch.cat([part, part.new_zeros(shard.padding, *part.shape[1:])]) if shard.padding else part

    def shard_of(self, name: str, num_rows: int) -> Shard:
        """Which part of checkpoint tensor ``name`` (of ``num_rows`` rows) this rank holds; the
        GGUF loader applies the same answer to quantized rows (engine/models/gguf_loader.py)."""
        if not self.stage.holds(name):
            return "none"
        layout = self.layout
        if layout is None:
            return "whole"
        head_dim = self.shape.head_dim
        rows_of = {
            "self_attn.q_proj": (layout.head_start * head_dim, layout.num_local_heads * head_dim),
            "self_attn.k_proj": (layout.kv_head_start * head_dim, layout.num_local_kv_heads * head_dim),
            "self_attn.v_proj": (layout.kv_head_start * head_dim, layout.num_local_kv_heads * head_dim),
            "mlp.gate_proj": (layout.rank * layout.local_intermediate_size, layout.local_intermediate_size),
            "mlp.up_proj": (layout.rank * layout.local_intermediate_size, layout.local_intermediate_size),
        }
        columns_of = {
            "self_attn.o_proj": (layout.head_start * head_dim, layout.num_local_heads * head_dim),
            "mlp.down_proj": (layout.rank * layout.local_intermediate_size, layout.local_intermediate_size),
        }
        for projection, (start, count) in rows_of.items():
            if f".{projection}." in name:
                return ShardSlice(0, start, count)
        for projection, (start, count) in columns_of.items():
            if f".{projection}." in name:
                if name.endswith(".bias"):
                    return "whole" if layout.rank == 0 else "none"  # added once, by rank 0
                return ShardSlice(1, start, count)
        if name.startswith("lm_head."):
            count = max(0, min(layout.local_vocab_size, num_rows - layout.vocab_start))
            return ShardSlice(0, layout.vocab_start, count, padding=layout.local_vocab_size - count)
        return "whole"  # replicated: the embedding, the norms


def map_name(
    name: str, fused: dict[str, tuple[str, int | None, int | None]], first_layer: int = 0
) -> tuple[str, int | None, int | None]:
    """``model.layers.3.self_attn.k_proj.weight`` -> (``layers.3.qkv_proj.weight``, offset, rows);
    ``first_layer``: the model's number of this process's first layer (a pipeline stage's)."""
    name = name.removeprefix("model.")
    if name.startswith("layers."):
        _, number, rest = name.split(".", 2)
        index = int(number) - first_layer
        for hf_name, (ours, offset, rows) in fused.items():
            if rest.startswith(hf_name + "."):
                return f"layers.{index}.{ours}{rest[len(hf_name) :]}", offset, rows
        return f"layers.{index}.{rest}", None, None
    return name, None, None
