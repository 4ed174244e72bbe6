"""Draft-model drafting: a smaller checkpoint of the same vocabulary guesses the next tokens.

The draft model keeps its own KV cache, laid out like the target's and addressed through the
target's block ids (the same number of blocks, so every slot the scheduler allocated for a
request exists in both caches). Its KV is its own business: it is never transferred, and a
request computes the draft's KV for its whole context, prompt included, the first time it
drafts (on a decode instance the prompt arrived as target KV from P; for a small draft model
that catch-up costs a fraction of one target prefill). ``request.num_draft_computed_tokens``
says how far it holds; rejected drafts roll it back with the target's count, and a
preemption resets it.

One step, for the requests the scheduler gave drafts (``propose``):

1. catch-up: one forward over each request's tokens the draft has not seen, up to its last
   known token; the last row's logits give draft 1;
2. ``k - 1`` one-token forwards, each feeding the previous draft, give drafts 2..k.

Greedy requests take the draft's argmax; sampled ones draw from the draft's temperature /
top-k / top-p / min-p distribution, which the rejection sampler needs to keep the output
exactly the target's.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Protocol

import numpy as np
import torch

from engine.attention.backend import select_backend
from engine.config import EngineConfig
from engine.flat_batch import build_flat_batch
from engine.kv_cache_layout import allocate_kv_cache, layer_views
from engine.models import load_model
from engine.models.llama import ModelShape
from engine.request import Request
from engine.sampler import Sampler, processed_probs
from engine.scheduler_output import SchedulerOutput
from engine.spec_decode.config import SpeculativeConfig

logger = logging.getLogger(__name__)


class TargetRunner(Protocol):
    """What the proposer needs of the target model's runner (``engine.model_runner.ModelRunner``,
    which owns the proposer): its device, dtype and KV block geometry to lay out the draft's
    cache like its own, its sampler to draw sampled drafts, its host-to-device copy."""

    config: EngineConfig
    device: torch.device
    dtype: torch.dtype
    shape: ModelShape
    block_size: int
    num_blocks: int
    max_model_len: int
    sampler: Sampler

    def to_device(self, array: np.ndarray) -> torch.Tensor: ...


class DraftModelProposer:
    def __init__(self, spec: SpeculativeConfig, target: TargetRunner) -> None:
        path = Path(spec.model or "").expanduser()
        if not (path / "config.json").is_file():
            raise ValueError(
                f"--speculative-model must be a local Hugging Face folder with config.json; {path} has none"
            )
        self.target = target
        self.block_size = target.block_size
        backend = select_backend(target.config.attention_backend, target.device)
        dtype_name = str(target.dtype).removeprefix("torch.")
        loaded = load_model(path, dtype_name, target.device, backend, None)
        self.model = loaded.model
        if self.model.shape.vocab_size != target.shape.vocab_size:
            raise ValueError(
                f"the draft model at {path} has a vocabulary of {self.model.shape.vocab_size} tokens, the target "
                f"{target.shape.vocab_size}; pick a draft checkpoint with the target's tokenizer and vocabulary"
            )
        if loaded.max_model_len < target.max_model_len:
            raise ValueError(
                f"the draft model at {path} supports {loaded.max_model_len} positions, fewer than the target's "
                f"{target.max_model_len}; pass a smaller --max-model-len or another draft"
            )
        shape = self.model.shape
        self.kv_cache = allocate_kv_cache(
            target.num_blocks,
            shape.num_layers,
            self.block_size,
            shape.num_kv_heads,
            shape.head_dim,
            target.dtype,
            target.device,
        )
        self.layer_caches = layer_views(self.kv_cache)
        logger.info(
            "draft model %s: %d layers, its own KV cache of %.1f MiB over the target's %d block ids",
            path,
            shape.num_layers,
            self.kv_cache.numel() * self.kv_cache.element_size() / 2**20,
            target.num_blocks,
        )

    @torch.inference_mode()
    def propose(self, output: SchedulerOutput) -> dict[str, torch.Tensor]:
        """Fill ``spec_token_ids`` of every request the step verifies drafts for. Returns, for
        sampled requests, the distributions their drafts were drawn from ([k, vocab] each)."""
        items = [s for s in output.scheduled if s.num_draft_tokens]
        requests = [s.request for s in items]
        num_drafts = [s.num_draft_tokens for s in items]
        greedy = [r.sampling_params.is_greedy for r in requests]
        drafts: list[list[int]] = [[] for _ in items]
        probs: list[list[torch.Tensor]] = [[] for _ in items]

        # 1. Catch-up over the tokens the draft has not seen, up to the last known token.
        num_computed = np.asarray([r.num_draft_computed_tokens for r in requests], dtype=np.int64)
        num_new = np.asarray([r.num_tokens for r in requests], dtype=np.int64) - num_computed
        input_ids = [t for r, c in zip(requests, num_computed) for t in r.all_token_ids[c:]]
        logits = self._forward(input_ids, num_new, num_computed, [s.block_ids for s in items])
        self._pick(logits, requests, greedy, drafts, probs, list(range(len(items))))

        # 2. One token at a time for the rest.
        for j in range(1, max(num_drafts)):
            active = [i for i, n in enumerate(num_drafts) if n > j]
            ones = np.ones(len(active), dtype=np.int64)
            positions = np.asarray([requests[i].num_tokens + j - 1 for i in active], dtype=np.int64)
            logits = self._forward(
                [drafts[i][-1] for i in active], ones, positions, [items[i].block_ids for i in active]
            )
            self._pick(logits, [requests[i] for i in active], [greedy[i] for i in active], drafts, probs, active)

        for request, request_drafts, n in zip(requests, drafts, num_drafts):
            request.spec_token_ids = request_drafts
            # Draft KV now holds the context and every draft but the last.
            request.num_draft_computed_tokens = request.num_tokens + n - 1
        return {r.request_id: torch.stack(p) for r, p, g in zip(requests, probs, greedy) if not g}

    def _forward(
        self, input_ids: list[int], num_new: np.ndarray, num_computed: np.ndarray, block_id_rows: list[list[int]]
    ) -> torch.Tensor:
        batch = build_flat_batch(
            input_ids,
            num_new,
            num_computed,
            block_id_rows,
            np.ones(len(num_new), dtype=bool),
            # All one-token rows run as decodes; a catch-up longer than one token runs every row
            # through the prefill path (correct for one-token rows too).
            len(num_new) if bool((num_new == 1).all()) else 0,
            self.block_size,
            self.target.to_device,
        )
        return self.model(batch.input_ids, batch.positions, self.layer_caches, batch.metadata, batch.logits_indices)

    def _pick(
        self,
        logits: torch.Tensor,
        requests: list[Request],
        greedy: list[bool],
        drafts: list[list[int]],
        probs: list[list[torch.Tensor]],
        indices: list[int],
    ) -> None:
        """Append one draft per row of ``logits`` ([len(indices), vocab]) to ``drafts[indices[row]]``."""
        token_ids = logits.argmax(-1).tolist()
        random_rows = [row for row, g in enumerate(greedy) if not g]
        if random_rows:
            row_probs = processed_probs(
                logits[random_rows].float(), [requests[row].sampling_params for row in random_rows]
            )
            row_probs.div_(row_probs.sum(-1, keepdim=True))
            for k, row in enumerate(random_rows):
                q = row_probs[k]
                token_ids[row] = int(self.target.sampler.race(q[None].clone(), [requests[row].generator])[0])
                probs[indices[row]].append(q)
        for row, token_id in enumerate(token_ids):
            drafts[indices[row]].append(token_id)
