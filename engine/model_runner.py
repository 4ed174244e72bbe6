"""Runs the model for a scheduled step: builds the flat batch, executes, samples.

It owns the device state — weights, the KV cache tensor and the sampler —
and nothing about which requests run; that is the scheduler's.
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import torch

from engine.attention.backend import select_backend
from engine.attention.metadata import AttentionMetadata
from engine.config import DEFAULT_KV_CACHE_MEMORY, EngineConfig
from engine.kv_cache_layout import allocate_kv_cache, layer_views
from engine.kv_cache_utils import kv_cache_bytes_per_block, num_blocks_for_budget
from engine.models import load_model
from engine.request import Request
from engine.sampler import Sampler, SamplingMetadata
from engine.scheduler_output import ModelOutput, SchedulerOutput
from engine.structured_output.bitmask import PendingBitmask
from engine.structured_output.manager import StructuredOutputManager

logger = logging.getLogger(__name__)


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {name!r} asked for, but CUDA is not available here; use --device cpu")
    return device


class ModelRunner:
    def __init__(self, config: EngineConfig, model_path: Path) -> None:
        self.config = config
        self.device = resolve_device(config.device)
        self.block_size = config.block_size
        backend = select_backend(config.attention_backend, self.device)
        loaded = load_model(model_path, config.dtype, self.device, backend, config.max_model_len)
        self.model, self.hf_config, self.architecture = loaded.model, loaded.config, loaded.architecture
        self.dtype = loaded.dtype
        self.shape = self.model.shape
        self.backend_name = backend.name
        self.bytes_per_block = kv_cache_bytes_per_block(
            self.shape.num_layers,
            self.block_size,
            self.shape.num_kv_heads,
            self.shape.head_dim,
            torch.tensor([], dtype=self.dtype).element_size(),
        )
        self.num_blocks = self._decide_num_blocks()
        # Block-major (engine/kv_cache_layout.py): a KV connector moves each block as one buffer.
        self.kv_cache = self._allocate_kv_cache(self.num_blocks)
        self.layer_caches = layer_views(self.kv_cache)
        # A KV capacity smaller than the context would leave a long request unschedulable forever.
        self.max_model_len = min(loaded.max_model_len, self.num_blocks * self.block_size)
        if self.max_model_len < loaded.max_model_len:
            logger.warning(
                "KV cache holds %d tokens, less than the model's context (%d): capping max_model_len",
                self.max_model_len,
                loaded.max_model_len,
            )
        logger.info(
            "KV cache: %d blocks x %d tokens = %d tokens (%.1f MiB, %d bytes per block), attention backend %s",
            self.num_blocks,
            self.block_size,
            self.num_blocks * self.block_size,
            self.num_blocks * self.bytes_per_block / 2**20,
            self.bytes_per_block,
            backend.name,
        )
        self.sampler = Sampler(seed=config.seed, device=self.device)
        self.structured_output: StructuredOutputManager | None = None  # set by the engine core

    # ------------------------------------------------------------------ sizing

    def _decide_num_blocks(self) -> int:
        if self.config.num_blocks_override is not None:
            return self.config.num_blocks_override
        if self.device.type != "cuda":
            return num_blocks_for_budget(self.config.kv_cache_memory or DEFAULT_KV_CACHE_MEMORY, self.bytes_per_block)
        return num_blocks_for_budget(self._profile_free_gpu_memory(), self.bytes_per_block)

    def _allocate_kv_cache(self, num_blocks: int) -> torch.Tensor:
        shape = self.shape
        return allocate_kv_cache(num_blocks, shape.num_layers, self.block_size, shape.num_kv_heads, shape.head_dim, self.dtype, self.device)

    def _profile_free_gpu_memory(self) -> int:
        """Memory left for KV after the weights and the activations of the largest step.

        Runs one forward pass of ``max_num_batched_tokens`` tokens against a scratch
        cache just big enough for it and measures the peak.
        """
        num_tokens = self.config.max_num_batched_tokens
        num_blocks = -(-num_tokens // self.block_size)
        scratch = self._allocate_kv_cache(num_blocks)
        torch.cuda.reset_peak_memory_stats(self.device)
        metadata = AttentionMetadata(
            num_decodes=0,
            slot_mapping=torch.arange(num_tokens, device=self.device),
            query_start_loc=torch.tensor([0, num_tokens], dtype=torch.int32, device=self.device),
            seq_lens=torch.tensor([num_tokens], dtype=torch.int32, device=self.device),
            block_tables=torch.arange(num_blocks, dtype=torch.int32, device=self.device)[None, :],
            max_query_len=num_tokens,
            max_seq_len=num_tokens,
            query_start_loc_cpu=[0, num_tokens],
            seq_lens_cpu=[num_tokens],
        )
        positions = torch.arange(num_tokens, device=self.device)
        self.model(positions % self.shape.vocab_size, positions, layer_views(scratch), metadata, positions[-1:])
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device)
        del scratch
        total = torch.cuda.get_device_properties(self.device).total_memory
        budget = int(total * self.config.gpu_memory_utilization) - peak
        if self.config.kv_cache_memory and self.config.kv_cache_memory < budget:
            budget = self.config.kv_cache_memory
        logger.info("GPU memory: total %.1f GiB, peak after profiling %.1f GiB", total / 2**30, peak / 2**30)
        return budget

    # --------------------------------------------------------------- execution

    def execute(self, output: SchedulerOutput, eos_token_ids: frozenset[int]) -> ModelOutput:
        """Run one scheduled step; returns a sampled token per request that samples."""
        input_ids, positions, metadata, logits_indices = self._prepare_inputs(output)
        sampling = [s.request for s in output.scheduled if s.samples]
        # Grammar masks for this step's tokens are computed while the forward pass runs.
        bitmask = self._start_bitmask(sampling)
        logits = self.model(input_ids, positions, self.layer_caches, metadata, logits_indices)
        if not sampling:
            return ModelOutput(sampled_token_ids=[], logprobs=[])
        sampler_output = self.sampler(
            logits,
            SamplingMetadata(
                params=[r.sampling_params for r in sampling],
                prompt_token_ids=[r.prompt_token_ids for r in sampling],
                output_token_ids=[r.output_token_ids for r in sampling],
                generators=[r.generator for r in sampling],
                eos_token_ids=eos_token_ids,
                grammar_rows=bitmask.rows if bitmask else [],
                grammar_bias=bitmask.result() if bitmask else None,
            ),
        )
        return ModelOutput(sampled_token_ids=sampler_output.token_ids, logprobs=sampler_output.logprobs)

    def _start_bitmask(self, sampling: list[Request]) -> PendingBitmask | None:
        """None (and no cost beyond one pass over the rows) when no row samples under a grammar."""
        rows = [i for i, r in enumerate(sampling) if r.grammar is not None]
        if not rows or self.structured_output is None:
            return None
        return self.structured_output.worker.start(rows, [sampling[i].grammar for i in rows])

    def _prepare_inputs(
        self, output: SchedulerOutput
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor]:
        scheduled = output.scheduled
        num_seqs = len(scheduled)
        num_new = np.fromiter((s.num_new_tokens for s in scheduled), dtype=np.int64, count=num_seqs)
        num_computed = np.fromiter((s.request.num_computed_tokens for s in scheduled), dtype=np.int64, count=num_seqs)
        query_start_loc = np.zeros(num_seqs + 1, dtype=np.int64)
        np.cumsum(num_new, out=query_start_loc[1:])
        seq_lens = num_computed + num_new
        num_tokens = int(query_start_loc[-1])

        # Token ids: one per decode, a slice per prefill chunk.
        input_ids: list[int] = []
        for s in scheduled:
            start = s.request.num_computed_tokens
            input_ids.extend(s.request.all_token_ids[start : start + s.num_new_tokens])
        # positions: each sequence's tokens continue from its computed prefix
        positions = np.arange(num_tokens, dtype=np.int64) - np.repeat(query_start_loc[:-1] - num_computed, num_new)

        max_seq_len = int(seq_lens.max())
        max_blocks = -(-max_seq_len // self.block_size)
        block_tables = np.zeros((num_seqs, max_blocks), dtype=np.int32)
        for row, s in enumerate(scheduled):
            ids = s.block_ids[:max_blocks]
            block_tables[row, : len(ids)] = ids
        seq_index = np.repeat(np.arange(num_seqs), num_new)
        slot_mapping = block_tables[seq_index, positions // self.block_size].astype(np.int64) * self.block_size + (
            positions % self.block_size
        )
        samples = np.fromiter((s.samples for s in scheduled), dtype=bool, count=num_seqs)
        logits_indices = query_start_loc[1:][samples] - 1

        to_device = self._to_device
        metadata = AttentionMetadata(
            num_decodes=output.num_decodes,
            slot_mapping=to_device(slot_mapping),
            query_start_loc=to_device(query_start_loc.astype(np.int32)),
            seq_lens=to_device(seq_lens.astype(np.int32)),
            block_tables=to_device(block_tables),
            max_query_len=int(num_new.max()),
            max_seq_len=max_seq_len,
            query_start_loc_cpu=query_start_loc.tolist(),
            seq_lens_cpu=seq_lens.tolist(),
        )
        return (
            to_device(np.asarray(input_ids, dtype=np.int64)),
            to_device(positions),
            metadata,
            to_device(logits_indices),
        )

    def _to_device(self, array: np.ndarray) -> torch.Tensor:
        tensor = torch.from_numpy(array)
        return tensor if self.device.type == "cpu" else tensor.to(self.device, non_blocking=True)
