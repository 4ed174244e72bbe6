"""The EAGLE (or EAGLE-3) draft's KV over a prompt, as it crosses the prefill/decode hand-off.

A prefill instance's EAGLE draft computes its KV over the prompt while the target prefills it
(engine/spec_decode/eagle.py): the entry of position ``i`` reads the target's feature ``f_i``
and token ``i + 1``, so the entries of positions ``start .. num_prompt_tokens - 1`` exist (the
last one read the first sampled token), where ``start`` is the first position P's target
computed (0, or the end of P's prefix-cache hit). A decode instance without them drafts
attending only over what came after the prompt (exact output, lower acceptance), so P hands
them over with the target's KV:

1. P, as the prefill ends: :meth:`EagleProposer.export_prompt` copies the entries into one
   :class:`PromptDraftKV` (``[num_layers, 2 (K, V), num_entries, num_kv_heads, head_dim]``,
   contiguous: one message on the wire), which ``KVHandoff.prompt_draft_kv`` carries to the
   prefill service; the service hands it to the KV connector beside the request's blocks
   (kv_connector/draft_kv.py), which drops it when it unpublishes them.
2. D's pull asks for it with the blocks and receives it into a tensor of its own (D sizes it
   from the prompt's length and P's ``start``, and refuses any other shape or dtype): the
   result goes to the engine in ``KVLoadResult.prompt_draft_kv``.
3. D's scheduler, applying the load, keeps it on the request (``Request.prompt_draft_kv``);
   the EAGLE proposer takes it at the request's first step as its draft KV, cut back there to
   the step's first position like any other.

Nothing of it is paged or prefix-cached: it lives on P from the end of prefill until the
blocks are unpublished, and on D from the load until the request's first step (or its end).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.spec_decode.eagle_draft import DraftKV


@dataclass(frozen=True, slots=True)
class PromptDraftKV:
    """Entries of positions ``start .. start + num_entries - 1`` of a draft's KV, every layer."""

    start: int
    kv: torch.Tensor  # [num_layers, 2, num_entries, num_kv_heads, head_dim], contiguous

    @property
    def num_entries(self) -> int:
        return self.kv.shape[2]

    @property
    def end(self) -> int:
        """The position after the last entry."""
        return self.start + self.num_entries


@dataclass(frozen=True, slots=True)
class DraftKVShape:
    """What one entry of a draft's KV is, to size a receive and check what a peer offers."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    device: torch.device

    @classmethod
    def of(cls, kv: DraftKV) -> DraftKVShape:
        """The shape of ``kv``'s entries (any draft KV of the draft: ``new_draft_kv(draft, 0)``)."""
        keys = kv.keys[0]
        return cls(len(kv.keys), keys.shape[1], keys.shape[2], keys.dtype, keys.device)

    @property
    def entry_shape(self) -> list[int]:
        """``[num_layers, 2, num_kv_heads, head_dim]``: what a peer's offer must name."""
        return [self.num_layers, 2, self.num_kv_heads, self.head_dim]

    @property
    def dtype_name(self) -> str:
        return str(self.dtype).removeprefix("torch.")

    def empty(self, start: int, num_entries: int) -> PromptDraftKV:
        """An uninitialised one to receive into."""
        kv = torch.empty(
            self.num_layers, 2, num_entries, self.num_kv_heads, self.head_dim, dtype=self.dtype, device=self.device
        )
        return PromptDraftKV(start, kv)


def snapshot(kv: DraftKV, end: int) -> PromptDraftKV:
    """A copy of ``kv``'s entries before position ``end`` (the prompt's; the chain's speculative
    entries after it stay behind)."""
    if not kv.start < end <= kv.end:
        raise RuntimeError(f"bug: a draft KV of positions {kv.start}..{kv.end - 1} has no entries up to {end}")
    num_entries = end - kv.start
    layers = [torch.stack([keys[:num_entries], values[:num_entries]]) for keys, values in zip(kv.keys, kv.values)]
    return PromptDraftKV(kv.start, torch.stack(layers).contiguous())


def to_draft_kv(prompt: PromptDraftKV) -> DraftKV:
    """A draft KV holding ``prompt``'s entries (views of its tensor: it grows into new ones)."""
    keys = [prompt.kv[layer, 0] for layer in range(prompt.kv.shape[0])]
    values = [prompt.kv[layer, 1] for layer in range(prompt.kv.shape[0])]
    return DraftKV(prompt.start, keys, values, length=prompt.num_entries)
