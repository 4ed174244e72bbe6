"""Medusa heads: K small heads on the target's last hidden state, each guessing one token further.

Head ``k`` (from 0) reads the final, normed hidden state ``h_i`` of the position whose logits
sampled token ``i + 1`` and guesses token ``i + 2 + k``: its ``num_layers`` residual blocks
``x + SiLU(W x + b)`` then a vocabulary projection (its own, one shared by every head, or the
target's LM head). The heads see neither the sampled token nor each other's guesses, so all K
drafts of a step come out of one batched pass over the hidden states the target computed
anyway: no draft forward, no draft KV. The chain is top-1 (each head's argmax), deterministic,
so the rejection sampler verifies it as it verifies n-gram drafts, exactly for greedy and
sampled requests alike.

One step, in call order:

1. ``ModelRunner.execute``: the target's forward fills the final hidden state of every row that
   yields logits (``final_hidden_out`` of ``LlamaFamilyForCausalLM.forward``, and of the native
   CPU decode step, engine/models/native_decode.py); the step samples or verifies as usual.
2. :meth:`MedusaProposer.propose`: per request that sampled, the row of its last emitted token's
   logits (after a verification: the row after its last accepted draft); the heads' drafts for
   the next step go back in ``ModelOutput.draft_token_ids``.
3. ``Scheduler.update`` keeps them as ``request.spec_token_ids``; at the next step
   ``EngineCore._plan_drafts`` asks for as many, and the scheduler fits what it can.

On a prefill instance the heads run once, after the first token: ``Scheduler.kv_handoff`` puts
their drafts in the ``KVHandoff``, prefill_svc puts them in the signed KV handle, and decode_svc
gives them to its engine (``EngineCore.add_request(draft_token_ids=...)``), which verifies drafts
from its first step. A request with neither (a P without heads) decodes one plain step, which
gives it a hidden state.

Checkpoints: engine/spec_decode/medusa_checkpoint.py.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.request import Request
from engine.scheduler_output import ModelOutput, SchedulerOutput


class ResidualBlocks(nn.Module):
    """One head's trunk: ``x + SiLU(W x + b)``, ``num_layers`` times (Medusa-1's ResBlock)."""

    def __init__(self, hidden_size: int, num_layers: int, bias: bool) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(hidden_size, hidden_size, bias=bias) for _ in range(num_layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = x + nn.functional.silu(layer(x))
        return x


class MedusaHeads(nn.Module):
    """Parameter names are vLLM's (``blocks.{head}.layers.{layer}``, ``lm_heads.{head}``), which
    the checkpoint loader maps other layouts onto. ``lm_heads``: one projection per head, one
    shared by all (a list of one), or none (the target's LM head, given to :meth:`forward`)."""

    def __init__(
        self,
        num_heads: int,
        num_layers: int,
        hidden_size: int,
        bias: bool,
        num_lm_heads: int,
        head_vocab_size: int,
    ) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.blocks = nn.ModuleList(ResidualBlocks(hidden_size, num_layers, bias) for _ in range(num_heads))
        self.lm_heads = nn.ModuleList(nn.Linear(hidden_size, head_vocab_size, bias=False) for _ in range(num_lm_heads))
        # The heads' vocabulary row -> the target's token id, when the heads predict over a
        # truncated vocabulary (vLLM's token_map); None: the same vocabulary.
        self.token_map: torch.Tensor | None = None

    def hidden_states(self, hidden: torch.Tensor, num_heads: int) -> torch.Tensor:
        """hidden: [R, hidden_size] -> the first ``num_heads`` heads' residual outputs [K, R, hidden_size]."""
        return torch.stack([block(hidden) for block in list(self.blocks)[:num_heads]])

    def logits(self, heads_hidden: torch.Tensor, target_lm_head: nn.Module) -> torch.Tensor:
        """[K, R, hidden_size] -> [K, R, vocab] logits over the heads' vocabulary."""
        num_heads, num_rows, hidden_size = heads_hidden.shape
        if len(self.lm_heads) > 1:
            return torch.stack([self.lm_heads[k](heads_hidden[k]) for k in range(num_heads)])
        # One projection for all heads: one matmul over its weight for every head's rows.
        projection = self.lm_heads[0] if len(self.lm_heads) == 1 else target_lm_head
        return projection(heads_hidden.reshape(num_heads * num_rows, hidden_size)).reshape(num_heads, num_rows, -1)

    @torch.inference_mode()
    def forward(self, hidden: torch.Tensor, num_heads: int, target_lm_head: nn.Module) -> torch.Tensor:
        """Top-1 drafts [R, num_heads] (target token ids) for hidden states [R, hidden_size]."""
        token_ids = self.logits(self.hidden_states(hidden, num_heads), target_lm_head).argmax(-1)  # [K, R]
        if self.token_map is not None:
            token_ids = self.token_map[token_ids]
        return token_ids.T


class MedusaProposer:
    """Drafts for the next step from this step's hidden states (module docstring)."""

    def __init__(self, heads: MedusaHeads, num_speculative_tokens: int, target_lm_head: nn.Module) -> None:
        if num_speculative_tokens > heads.num_heads:
            raise ValueError(
                f"the Medusa checkpoint has {heads.num_heads} heads, fewer than the {num_speculative_tokens} "
                "speculative tokens asked for; ask for at most that many (num_speculative_tokens)"
            )
        self.heads = heads
        self.num_speculative_tokens = num_speculative_tokens
        self.target_lm_head = target_lm_head

    def propose(self, output: SchedulerOutput, model_output: ModelOutput, hidden: torch.Tensor) -> list[list[int]]:
        """``hidden``: [R, hidden_size], the final hidden state of each logits row of the step
        (a sampling request's one row, or a verifying request's ``1 + drafts`` rows). Returns the
        drafts of every sampling request, in schedule order (none for one that may not speculate)."""
        rows: list[int] = []
        wanted: list[int] = []  # index into the sampling requests
        row = 0
        sample_index = 0
        for item in output.scheduled:
            if not item.samples:
                continue
            accepted = model_output.accepted_token_ids[sample_index] if model_output.accepted_token_ids else []
            if _may_speculate(item.request):
                rows.append(row + len(accepted))
                wanted.append(sample_index)
            row += item.num_draft_tokens + 1
            sample_index += 1
        drafts: list[list[int]] = [[] for _ in range(sample_index)]
        if rows:
            token_ids = self.heads(hidden[rows], self.num_speculative_tokens, self.target_lm_head).tolist()
            for index, request_drafts in zip(wanted, token_ids):
                drafts[index] = request_drafts
        return drafts


def _may_speculate(request: Request) -> bool:
    return request.sampling_params.can_speculate
