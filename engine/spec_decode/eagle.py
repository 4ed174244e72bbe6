"""EAGLE drafts (EAGLE-1/2 chains): a one-layer decoder that extrapolates the target's features.

The target's feature ``f_i`` is its final, normed hidden state at position ``i`` (the one its LM
head turns into the logits of token ``i + 1``). The draft's entry at position ``i`` reads
``fc(concat(embed(t_{i + 1}), f_i))`` through its decoder layer(s), attending over its own
earlier entries, and its output ``g_i`` stands for ``f_{i + 1}``: the LM head (the target's,
unless the checkpoint has its own) turns it into a guess of token ``i + 2``. A chain of ``k``
drafts feeds each guess back with the output that made it, ``(d_j, g)``, one entry at a time.
The chain is top-1 (argmax), deterministic, so the rejection sampler verifies it as it verifies
Medusa's, exactly for greedy and sampled requests alike.

The draft's KV is a contiguous tensor per request and layer (:class:`DraftKV`), not paged: its
entries start at the first position whose feature this engine computed and grow by one entry per
token whose feature and successor are both known. Speculative entries (those made from the
draft's own outputs) are cut off at the next step, before the entries of the verified tokens are
written in their place. Positions this engine never ran the target over have no entry: a prompt
pulled from a prefill instance, or a prefix-cache hit, leaves the draft attending only over what
came after (the output stays exact; only acceptance can be lower).

One step, in call order:

1. ``ModelRunner.execute``: :meth:`EagleProposer.target_forward` runs the target and keeps the
   feature of every token of the step (prefill chunks included), not only of the logits rows;
   the step samples or verifies as usual.
2. :meth:`EagleProposer.propose`: per scheduled request, its draft KV is cut back to the step's
   first position, then extended over the step's tokens whose feature and next token are known
   (a verifying request: its last known token and the drafts accepted); the sampling requests
   that may speculate then run their chains, whose drafts go back in
   ``ModelOutput.draft_token_ids``.
3. ``Scheduler.update`` keeps them as ``request.spec_token_ids``; at the next step
   ``EngineCore._plan_drafts`` asks for as many, and the scheduler fits what it can.

The draft runs a step's requests in one pass per chain depth (and one over all new entries
before), with attention alone run request by request over each one's own draft KV. A finished or
aborted request's draft KV is dropped at the next step (the runner learns of it from the
request's status); a preempted one's at once.

Checkpoints: engine/spec_decode/eagle_checkpoint.py.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn
from transformers import LlamaConfig

from engine.flat_batch import FlatBatch
from engine.models.llama import LlamaFamilyForCausalLM
from engine.models.ops import TorchOps
from engine.models.rotary import RotaryEmbedding
from engine.request import Request
from engine.scheduler_output import ModelOutput, SchedulerOutput


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
        values up to them. ``length`` moves on once every layer has stored (:meth:`advance`)."""
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


@dataclass(slots=True)
class _Extension:
    """A request's entries of one step: tokens ``start + 1 ..`` with features of ``start ..``."""

    held: _Held
    start: int
    token_ids: list[int]
    features: torch.Tensor  # [len(token_ids), hidden_size]


@dataclass(slots=True)
class _Held:
    request: Request
    kv: DraftKV
    # The last entry's output: what the chain's next entry reads as its feature.
    last_output: torch.Tensor | None = field(default=None)


class EagleLayer(nn.Module):
    """A Llama decoder layer over a :class:`DraftKV`; parameter names are transformers' (and the
    EAGLE checkpoints'), so a checkpoint loads with ``load_state_dict``."""

    def __init__(self, shape: EagleDraftShape, index: int, rotary: RotaryEmbedding) -> None:
        super().__init__()
        hidden, head_dim = shape.hidden_size, shape.head_dim
        self.index = index
        self.num_heads, self.num_kv_heads, self.head_dim = shape.num_heads, shape.num_kv_heads, head_dim
        # EAGLE's first layer reads fc's output as it is (its input norm removed).
        self.input_layernorm = RMSNorm(hidden, shape.rms_norm_eps) if index > 0 or shape.layernorms else None
        self.self_attn = nn.Module()
        self.self_attn.q_proj = nn.Linear(hidden, shape.num_heads * head_dim, bias=shape.attention_bias)
        self.self_attn.k_proj = nn.Linear(hidden, shape.num_kv_heads * head_dim, bias=shape.attention_bias)
        self.self_attn.v_proj = nn.Linear(hidden, shape.num_kv_heads * head_dim, bias=shape.attention_bias)
        self.self_attn.o_proj = nn.Linear(shape.num_heads * head_dim, hidden, bias=shape.attention_bias)
        self.post_attention_layernorm = RMSNorm(hidden, shape.rms_norm_eps)
        self.mlp = nn.Module()
        self.mlp.gate_proj = nn.Linear(hidden, shape.intermediate_size, bias=shape.mlp_bias)
        self.mlp.up_proj = nn.Linear(hidden, shape.intermediate_size, bias=shape.mlp_bias)
        self.mlp.down_proj = nn.Linear(shape.intermediate_size, hidden, bias=shape.mlp_bias)
        self.rotary = [rotary]  # shared by the layers; a list keeps it out of the state dict

    def forward(
        self, hidden: torch.Tensor, positions: torch.Tensor, kvs: Sequence[DraftKV], counts: Sequence[int]
    ) -> torch.Tensor:
        """hidden: [T, hidden_size], the entries at ``positions``: ``counts[r]`` of them (in order)
        after ``kvs[r]``'s, for each request ``r``."""
        num_tokens = hidden.shape[0]
        attn_in = hidden if self.input_layernorm is None else self.input_layernorm(hidden)
        attn = self.self_attn
        q = attn.q_proj(attn_in).view(num_tokens, self.num_heads, self.head_dim)
        k = attn.k_proj(attn_in).view(num_tokens, self.num_kv_heads, self.head_dim)
        v = attn.v_proj(attn_in).view(num_tokens, self.num_kv_heads, self.head_dim)
        rotary = self.rotary[0]
        cos, sin = rotary.cos[positions].unsqueeze(1), rotary.sin[positions].unsqueeze(1)  # [T, 1, D/2]
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        # Each request attends over its own cache: one small attention per request.
        outs = []
        first = 0
        for kv, count in zip(kvs, counts):
            rows = slice(first, first + count)
            keys, values = kv.append(self.index, k[rows], v[rows])  # [L, H_kv, D], the new entries last
            outs.append(_causal_attention(q[rows], keys, values))
            first += count
        out = outs[0] if len(outs) == 1 else torch.cat(outs)
        hidden = hidden + attn.o_proj(out.reshape(num_tokens, -1))
        mlp_in = self.post_attention_layernorm(hidden)
        return hidden + self.mlp.down_proj(F.silu(self.mlp.gate_proj(mlp_in)) * self.mlp.up_proj(mlp_in))


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


class EagleDraft(nn.Module):
    """``fc(concat(embed(token), feature))`` through the layers; the LM head outside (its own or
    the target's, :meth:`logits`)."""

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

    def forward(
        self,
        embeds: torch.Tensor,
        features: torch.Tensor,
        positions: torch.Tensor,
        kvs: Sequence[DraftKV],
        counts: Sequence[int],
    ) -> torch.Tensor:
        """embeds, features: [T, hidden_size] (token ``i + 1``'s embedding, the feature of ``i``),
        ``counts[r]`` rows for request ``r`` in order; stores their entries after ``kvs[r]``'s.
        Returns the outputs [T, hidden_size]."""
        if self.post_embedding_layernorm is not None:
            embeds = self.post_embedding_layernorm(embeds)
        hidden = self.fc(torch.cat([embeds, features.to(embeds.dtype)], dim=-1))
        for layer in self.layers:
            hidden = layer(hidden, positions, kvs, counts)
        for kv, count in zip(kvs, counts):
            kv.length += count
        return hidden

    def logits(self, outputs: torch.Tensor, target_lm_head: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        if self.pre_lm_head_layernorm is not None:
            outputs = self.pre_lm_head_layernorm(outputs)
        return (self.lm_head if self.lm_head is not None else target_lm_head)(outputs)


def new_draft_kv(draft: EagleDraft, start: int, capacity: int = 16) -> DraftKV:
    """An empty draft KV whose first entry will be position ``start`` (it grows as it fills)."""
    shape, weight = draft.shape, draft.fc.weight
    empty = [weight.new_empty(capacity, shape.num_kv_heads, shape.head_dim) for _ in range(2 * shape.num_layers)]
    return DraftKV(start, empty[: shape.num_layers], empty[shape.num_layers :])


Forward = Callable[[FlatBatch, torch.Tensor | None], torch.Tensor]


class EagleProposer:
    """Drafts for the next step from this step's features (module docstring)."""

    def __init__(self, draft: EagleDraft, num_speculative_tokens: int, target: LlamaFamilyForCausalLM) -> None:
        if draft.shape.hidden_size != target.shape.hidden_size:
            raise RuntimeError("bug: the EAGLE draft's hidden size was not checked against the target's")
        if target.layout is not None or not target.stage.is_whole:
            raise ValueError(
                "EAGLE speculation runs on a whole target only (its draft reads every layer's output on one "
                "rank); drop --tensor-parallel-size / --pipeline-parallel-size, or speculate with medusa or ngram"
            )
        self.draft = draft
        self.num_speculative_tokens = num_speculative_tokens
        self.target = target
        self.embed = draft.embed_tokens if draft.embed_tokens is not None else target.embed_tokens
        self.held: dict[str, _Held] = {}  # request id -> its draft KV

    @torch.inference_mode()
    def target_forward(
        self, batch: FlatBatch, forward: Forward, layer_caches: list[torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The target's logits of the batch's ``logits_indices`` rows, and the feature of every
        token [T, hidden_size]. A step whose every token yields logits (decodes, verifications)
        goes through ``forward`` (the runner's, native on CPU); one with prompt chunks runs the
        layers and norms every row."""
        num_tokens = batch.input_ids.shape[0]
        target = self.target
        if batch.logits_indices.shape[0] == num_tokens:
            weight = self.draft.fc.weight  # the runner's dtype and device (the embedding may be quantized)
            hidden = torch.empty(num_tokens, target.shape.hidden_size, dtype=weight.dtype, device=weight.device)
            return forward(batch, hidden), hidden
        hidden, residual = target.run_layers(
            batch.positions, target.embed_tokens(batch.input_ids), None, layer_caches, batch.metadata
        )
        features, _ = target.norm(hidden, residual)
        return target.lm_head(features[batch.logits_indices]).float(), features

    @torch.inference_mode()
    def propose(
        self, output: SchedulerOutput, model_output: ModelOutput | None, features: torch.Tensor
    ) -> list[list[int]]:
        """Extend each scheduled request's draft KV over this step's tokens; returns the drafts of
        every sampling request, in schedule order (none for one that may not speculate)."""
        self._drop_finished(output)
        extensions: list[_Extension] = []
        sampled: list[_Held | None] = []  # per sampling request: the one to chain from, if any
        row = 0
        sample_index = 0
        for item in output.scheduled:
            request = item.request
            start = request.num_computed_tokens  # the step's first position
            num_rows = item.num_new_tokens
            known = request.all_token_ids
            if item.samples and model_output is not None:
                accepted = model_output.accepted_token_ids[sample_index] if model_output.accepted_token_ids else []
                known = [*known, *accepted, model_output.sampled_token_ids[sample_index]]
                num_valid = len(accepted) + 1 if item.num_draft_tokens else num_rows
            else:
                num_valid = num_rows
            # Entries need the next token: every position of the step but a sampled one's last.
            num_entries = min(num_valid, len(known) - 1 - start)
            held = self._cut_back(request, start, num_entries)
            if held is not None and num_entries:
                token_ids = known[start + 1 : start + 1 + num_entries]
                extensions.append(_Extension(held, start, token_ids, features[row : row + num_entries]))
            row += num_rows
            if item.samples:
                sample_index += 1
                sampled.append(held if num_entries and request.sampling_params.can_speculate else None)
        if row != features.shape[0]:
            raise RuntimeError(f"bug: the step scheduled {row} tokens, the target gave {features.shape[0]} features")
        if extensions:
            self._extend(extensions)
        chained = [held for held in sampled if held is not None]
        chains = iter(self._chains(chained) if chained else [])
        return [next(chains) if held is not None else [] for held in sampled]

    def _drop_finished(self, output: SchedulerOutput) -> None:
        for request_id in output.preempted_request_ids:
            self.held.pop(request_id, None)
        for request_id in [r for r, held in self.held.items() if held.request.status.is_finished]:
            del self.held[request_id]

    def _cut_back(self, request: Request, start: int, num_entries: int) -> _Held | None:
        """The request's draft KV cut back to ``start`` (a new one there when it holds none that
        reaches it); None when it would hold no entry at all."""
        held = self.held.get(request.request_id)
        if held is None or not held.kv.start <= start <= held.kv.end:
            # New, recomputed after a preemption, or after positions this engine did not compute.
            if not num_entries:
                self.held.pop(request.request_id, None)
                return None
            held = _Held(request, new_draft_kv(self.draft, start))
            self.held[request.request_id] = held
        held.kv.length = start - held.kv.start
        held.request = request
        held.last_output = None  # until the entries of this step are in
        return held

    def _extend(self, extensions: list[_Extension]) -> None:
        """One draft pass over every request's new entries; each keeps its last entry's output."""
        device = extensions[0].features.device
        token_ids = torch.tensor([t for e in extensions for t in e.token_ids], device=device)
        positions = torch.tensor(
            [p for e in extensions for p in range(e.start, e.start + len(e.token_ids))], device=device
        )
        features = torch.cat([e.features for e in extensions])
        counts = [len(e.token_ids) for e in extensions]
        outputs = self.draft(self.embed(token_ids), features, positions, [e.held.kv for e in extensions], counts)
        end = 0
        for extension, count in zip(extensions, counts):
            end += count
            extension.held.last_output = outputs[end - 1 : end]

    def _chains(self, helds: list[_Held]) -> list[list[int]]:
        """``num_speculative_tokens`` top-1 drafts after each request's last entry, the requests
        side by side; the chains' entries stay in their draft KV until the next step cuts them off."""
        last = [held.last_output for held in helds]
        if any(output is None for output in last):
            raise RuntimeError("bug: an EAGLE chain without an entry to start from")
        outputs = torch.cat(last)  # type: ignore[arg-type]
        drafts: list[list[int]] = [[] for _ in helds]
        kvs = [held.kv for held in helds]
        ones = [1] * len(helds)
        for j in range(self.num_speculative_tokens):
            token_ids = self.draft.logits(outputs, self.target.lm_head).argmax(-1)  # [R]
            for chain, token_id in zip(drafts, token_ids.tolist()):
                chain.append(token_id)
            if j + 1 < self.num_speculative_tokens:
                positions = torch.tensor([kv.end for kv in kvs], device=outputs.device)
                outputs = self.draft(self.embed(token_ids), outputs, positions, kvs, ones)
        return drafts

    @property
    def num_requests_held(self) -> int:
        return len(self.held)
