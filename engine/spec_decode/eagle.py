"""EAGLE drafts (EAGLE-1/2 and EAGLE-3 chains): a one-layer decoder that extrapolates the target's features.

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
written in their place. Positions this engine never ran the target over have no entry: a
prefix-cache hit leaves the draft attending only over what came after (the output stays exact;
only acceptance can be lower). A prompt pulled from a prefill instance comes with the entries P's
draft made over it (engine/spec_decode/prompt_draft_kv.py: :meth:`EagleProposer.export_prompt`
on P, ``Request.prompt_draft_kv`` taken at D's first step), and with P's first chain, which D
verifies at that step.

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

EAGLE-3 (engine/spec_decode/eagle3_draft.py) differs behind
:class:`~engine.spec_decode.eagle_draft.DraftNetwork`: its feature ``f_i`` is the concatenated
residual streams entering three target layers (``LlamaFamilyForCausalLM.run_layers_capturing``;
in a decode or verify step the runner's native decode call captures them itself:
engine/models/native_decode.py's ``LayerCapture``), which its ``fc`` fuses before the layer
reads them (a chain's entries read the draft's own outputs unfused), and its LM head drafts in a
vocabulary of its own, mapped to the target's ids.

The draft models: engine/spec_decode/eagle_draft.py, eagle3_draft.py; checkpoints:
eagle_checkpoint.py, eagle3_checkpoint.py.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from engine.flat_batch import FlatBatch
from engine.models.llama import LlamaFamilyForCausalLM
from engine.models.native_decode import LayerCapture, NativeDecodeStep, capture_layer_ids
from engine.request import Request
from engine.scheduler_output import ModelOutput, SchedulerOutput
from engine.spec_decode.eagle_draft import DraftEntries, DraftKV, DraftNetwork, new_draft_kv
from engine.spec_decode.prompt_draft_kv import PromptDraftKV, snapshot, to_draft_kv


@dataclass(slots=True)
class _Extension:
    """A request's entries of one step: tokens ``start + 1 ..`` with features of ``start ..``."""

    held: _Held
    start: int
    token_ids: list[int]
    features: torch.Tensor  # [len(token_ids), the draft's feature width]


@dataclass(slots=True)
class _Held:
    request: Request
    kv: DraftKV
    # The last entry's output: what the chain's next entry reads as its feature.
    last_output: torch.Tensor | None = field(default=None)


Forward = Callable[[FlatBatch, torch.Tensor | None], torch.Tensor]


class EagleProposer:
    """Drafts for the next step from this step's features (module docstring)."""

    def __init__(
        self,
        draft: DraftNetwork,
        num_speculative_tokens: int,
        target: LlamaFamilyForCausalLM,
        native: NativeDecodeStep | None = None,
    ) -> None:
        """``native``: the runner's native decode step, if it has one, which also captures EAGLE-3's
        layers in the steps it takes (without it such a step would leave the native path)."""
        if draft.target_hidden_size != target.shape.hidden_size:
            raise RuntimeError("bug: the EAGLE draft's hidden size was not checked against the target's")
        if target.layout is not None or not target.stage.is_whole:
            raise ValueError(
                "EAGLE speculation runs on a whole target only (its draft reads every layer's output on one "
                "rank); drop --tensor-parallel-size / --pipeline-parallel-size, or speculate with medusa or ngram"
            )
        self.draft = draft
        self.num_speculative_tokens = num_speculative_tokens
        self.target = target
        self.native = native
        layer_ids = draft.feature_layer_ids
        self._capture_ids = capture_layer_ids(layer_ids) if native is not None and layer_ids is not None else None
        self.embed = draft.embed_tokens if draft.embed_tokens is not None else target.embed_tokens
        self.held: dict[str, _Held] = {}  # request id -> its draft KV

    @torch.inference_mode()
    def target_forward(
        self, batch: FlatBatch, forward: Forward, layer_caches: list[torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The target's logits of the batch's ``logits_indices`` rows, and the feature of every
        token [T, feature width]. A step whose every token yields logits (decodes, verifications)
        goes through ``forward`` (the runner's, native on CPU); one with prompt chunks runs the
        layers and norms every row; an EAGLE-3 draft's step captures its layers' inputs, natively
        where the runner's native step takes it."""
        num_tokens = batch.input_ids.shape[0]
        target = self.target
        layer_ids = self.draft.feature_layer_ids
        if layer_ids is not None:
            if (
                self.native is not None
                and self._capture_ids is not None
                and batch.logits_indices.shape[0] == num_tokens
            ):
                hidden_size = target.shape.hidden_size
                capture = LayerCapture.of(self._capture_ids, num_tokens, hidden_size, self.native.hidden_dtype)
                logits = self.native(batch, None, capture)
                if logits is not None:
                    return logits, capture.out
            hidden, residual, features = target.run_layers_capturing(
                batch.positions, target.embed_tokens(batch.input_ids), layer_caches, batch.metadata, layer_ids
            )
            return target.compute_logits(hidden, residual, batch.logits_indices), features
        if batch.logits_indices.shape[0] == num_tokens:
            draft = self.draft  # in the runner's dtype and on its device (the embedding may be quantized)
            hidden = torch.empty(num_tokens, target.shape.hidden_size, dtype=draft.dtype, device=draft.device)
            return forward(batch, hidden), hidden
        hidden, residual = target.run_layers(
            batch.positions, target.embed_tokens(batch.input_ids), None, layer_caches, batch.metadata
        )
        features, _ = target.norm(hidden, residual)
        return target.lm_head(features[batch.logits_indices]).float(), features

    @torch.inference_mode()
    def propose(
        self, output: SchedulerOutput, model_output: ModelOutput | None, features: torch.Tensor, chain: bool = True
    ) -> list[list[int]]:
        """Extend each scheduled request's draft KV over this step's tokens; returns the drafts of
        every sampling request, in schedule order (none for one that may not speculate).

        Without ``chain`` (the batch has turned speculation down) no draft runs at all: each
        scheduled request's draft KV is dropped rather than kept up, which would cost a draft pass
        over the batch every step. Once the batch is smaller a new one starts from that step's
        position: exact, only fewer drafts accepted until it has some context again."""
        self._drop_finished(output)
        if not chain:
            for item in output.scheduled:
                self.held.pop(item.request.request_id, None)
            return [[] for item in output.scheduled if item.samples]
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
        if held is None and request.prompt_draft_kv is not None:
            # The prompt's entries, from the prefill instance (engine/spec_decode/prompt_draft_kv.py).
            held = self.held[request.request_id] = _Held(request, to_draft_kv(request.prompt_draft_kv))
            request.prompt_draft_kv = None
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
        features = self.draft.fuse(torch.cat([e.features for e in extensions]))
        counts = [len(e.token_ids) for e in extensions]
        entries = DraftEntries(positions, [e.held.kv for e in extensions], counts)
        outputs = self.draft(self.embed(token_ids), features, entries)
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
            token_ids = self.draft.draft_token_ids(outputs, self.target.lm_head)  # [R], the target's ids
            for chain, token_id in zip(drafts, token_ids.tolist()):
                chain.append(token_id)
            if j + 1 < self.num_speculative_tokens:
                positions = torch.tensor([kv.end for kv in kvs], device=outputs.device)
                outputs = self.draft(self.embed(token_ids), outputs, DraftEntries(positions, kvs, ones))
        return drafts

    def export_prompt(self, request: Request) -> PromptDraftKV | None:
        """Prefill role, as the request's prefill ends: a copy of its draft KV's prompt entries,
        for the hand-off (engine/spec_decode/prompt_draft_kv.py); None if it holds none."""
        held = self.held.get(request.request_id)
        if held is None or not held.kv.start < request.num_prompt_tokens <= held.kv.end:
            return None
        return snapshot(held.kv, request.num_prompt_tokens)

    @property
    def num_requests_held(self) -> int:
        return len(self.held)
