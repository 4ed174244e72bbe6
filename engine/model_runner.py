"""Runs the model for a scheduled step: builds the flat batch, executes, samples.

It owns the device state — weights, the KV cache tensor and the sampler —
and nothing about which requests run; that is the scheduler's.
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import torch
from torch import nn

from engine.attention.backend import AttentionBackend, select_backend
from engine.attention.metadata import AttentionMetadata
from engine.config import DEFAULT_KV_CACHE_MEMORY, EngineConfig
from engine.flat_batch import FlatBatch, build_flat_batch
from engine.kv_cache_dtype import KVCacheFormat
from engine.kv_cache_layout import allocate_kv_cache, layer_views
from engine.kv_cache_utils import cdiv, kv_cache_bytes_per_block, num_blocks_for_budget
from engine.models import load_model, native_decode
from engine.models.quantized_model import keeps_quantized_weights
from engine.request import Request
from engine.sampler import Sampler, SamplingMetadata
from engine.scheduler_output import ModelOutput, PendingStep, SchedulerOutput
from engine.spec_decode.config import EAGLE_METHODS, SpeculativeConfig
from engine.spec_decode.draft_linears import prepare_draft_linears
from engine.spec_decode.draft_model import DraftModelProposer
from engine.spec_decode.eagle import EagleProposer
from engine.spec_decode.eagle3_checkpoint import load_eagle3_draft
from engine.spec_decode.eagle3_draft import Eagle3Draft
from engine.spec_decode.eagle_checkpoint import load_eagle_draft
from engine.spec_decode.eagle_draft import EagleDraft
from engine.spec_decode.medusa import MedusaProposer
from engine.spec_decode.medusa_checkpoint import load_medusa_heads
from engine.spec_decode.rejection_sampler import RejectionSampler
from engine.structured_output.bitmask import PendingBitmask
from engine.structured_output.manager import StructuredOutputManager
from engine.tensor_parallel.executor import TensorParallelExecutor

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
        # Tensor or pipeline parallel: this process is rank 0 (the last stage's), with workers for
        # the other ranks (spawned first: they load their shards while this one loads its own).
        self.tensor_parallel: TensorParallelExecutor | None = None
        if config.world_size > 1:
            self.tensor_parallel = TensorParallelExecutor.start(config, model_path, self.device)
        try:
            self._load(config, model_path, backend)
        except BaseException:
            self.close()
            raise

    def _load(self, config: EngineConfig, model_path: Path, backend: AttentionBackend) -> None:
        group = self.tensor_parallel.group if self.tensor_parallel is not None else None
        loaded = load_model(
            model_path,
            config.dtype,
            self.device,
            backend,
            config.max_model_len,
            group,
            config.quantization,
            activations=config.quant_activations,
            stage=self.tensor_parallel.stage if self.tensor_parallel is not None else None,
        )
        self.model, self.hf_config, self.architecture = loaded.model, loaded.config, loaded.architecture
        self.dtype = loaded.dtype
        self.shape = self.model.shape
        self.backend_name = backend.name
        # How K and V are stored: the model's dtype, or 8-bit rows with their scales (--kv-cache-dtype).
        self.kv_format = KVCacheFormat(config.kv_cache_dtype, self.dtype, self.shape.head_dim)
        # One rank's share of a block: its KV heads of its stage's layers (all of them without
        # tensor or pipeline parallelism).
        self.bytes_per_block = kv_cache_bytes_per_block(
            len(self.model.layers),
            self.block_size,
            self.model.local.num_kv_heads,
            self.kv_format.row_elements,
            self.kv_format.cache_dtype.itemsize,
        )
        self.num_blocks = self._decide_num_blocks()
        if self.tensor_parallel is not None:
            self.tensor_parallel.share_num_blocks(self.num_blocks)
        # Block-major (engine/kv_cache_layout.py): a KV connector moves each block as one buffer.
        self.kv_cache = self._allocate_kv_cache(self.num_blocks)
        self.layer_caches = layer_views(self.kv_cache, config.kv_cache_dtype)
        # A KV capacity smaller than the context would leave a long request unschedulable forever.
        self.max_model_len = min(loaded.max_model_len, self.num_blocks * self.block_size)
        if self.max_model_len < loaded.max_model_len:
            logger.warning(
                "KV cache holds %d tokens, less than the model's context (%d): capping max_model_len",
                self.max_model_len,
                loaded.max_model_len,
            )
        logger.info(
            "KV cache: %d blocks x %d tokens = %d tokens (%.1f MiB, %d bytes per block%s, %s), attention backend %s",
            self.num_blocks,
            self.block_size,
            self.num_blocks * self.block_size,
            self.num_blocks * self.bytes_per_block / 2**20,
            self.bytes_per_block,
            f" on this rank of {config.world_size}" if self.tensor_parallel is not None else "",
            self.kv_format.fingerprint_dtype,
            backend.name,
        )
        # CPU decode steps in one native call where the model allows (engine/models/native_decode.py).
        self.native_decode = native_decode.build(self.model, self.layer_caches) if self.device.type == "cpu" else None
        self.sampler = Sampler(seed=config.seed, device=self.device)
        self.structured_output: StructuredOutputManager | None = None  # set by the engine core
        self.rejection_sampler = RejectionSampler(self.sampler)
        self.draft_model: DraftModelProposer | None = None
        spec = self.speculative = config.speculative
        if spec is not None and spec.method == "draft_model" and config.role != "prefill":
            self.draft_model = DraftModelProposer(spec, self)
        # Medusa on the prefill role too: its heads draft once, after the first token, and the
        # drafts travel with the KV hand-off (engine/spec_decode/medusa.py).
        self.medusa: MedusaProposer | None = None
        if spec is not None and spec.method == "medusa":
            heads = load_medusa_heads(
                Path(spec.model or ""), self.shape.hidden_size, self.shape.vocab_size, self.dtype, self.device
            )
            self._prepare_drafter(heads, "Medusa heads")
            self.medusa = MedusaProposer(heads, spec.num_speculative_tokens, self.model.lm_head)
        # EAGLE and EAGLE-3 draft from the features of every token this engine computes
        # (engine/spec_decode/eagle.py); on the prefill role too, as Medusa: the chain after the
        # first token and the draft's KV over the prompt travel with the hand-off.
        self.eagle: EagleProposer | None = None
        if spec is not None and spec.method in EAGLE_METHODS:
            draft = self._load_eagle_draft(spec)
            self._prepare_drafter(draft, f"the {spec.method} draft")
            self.eagle = EagleProposer(draft, spec.num_speculative_tokens, self.model, self.native_decode)

    def _prepare_drafter(self, drafter: nn.Module, what: str) -> None:
        """The drafter's linear layers in the target's form (engine/spec_decode/draft_linears.py)."""
        quantized = keeps_quantized_weights(self.model)
        form = prepare_draft_linears(drafter, self.device, self.dtype, quantized, self.config.quant_activations)
        logger.info("%s: linear layers %s", what, form)

    def _load_eagle_draft(self, spec: SpeculativeConfig) -> EagleDraft | Eagle3Draft:
        folder = Path(spec.model or "")
        max_positions = self.max_model_len + spec.num_speculative_tokens  # a chain runs past the last token
        shape = self.shape
        if spec.method == "eagle3":
            return load_eagle3_draft(
                folder, shape.hidden_size, shape.vocab_size, shape.num_layers, max_positions, self.dtype, self.device
            )
        return load_eagle_draft(folder, shape.hidden_size, shape.vocab_size, max_positions, self.dtype, self.device)

    # ------------------------------------------------------------------ sizing

    def _decide_num_blocks(self) -> int:
        """Blocks every rank allocates. On CPU ``kv_cache_memory`` is the instance's, split
        evenly over its ranks; on GPU each rank has its device's memory."""
        if self.config.num_blocks_override is not None:
            return self.config.num_blocks_override
        if self.device.type != "cuda":
            budget = (self.config.kv_cache_memory or DEFAULT_KV_CACHE_MEMORY) // self.config.tensor_parallel_size
            # A block's bytes on one tensor-parallel rank of every stage: pipeline stages split the
            # layers, so the instance's budget holds as many blocks as without them.
            return num_blocks_for_budget(budget, self.bytes_per_block // len(self.model.layers) * self.shape.num_layers)
        if self.tensor_parallel is not None:
            # Written for GPUs, untested where none is lent: no profiling pass (it would need every
            # rank's forward); the weights this rank holds and a headroom for activations are kept.
            total = torch.cuda.get_device_properties(self.device).total_memory
            budget = int(total * self.config.gpu_memory_utilization) - 2 * torch.cuda.memory_allocated(self.device)
            if self.config.kv_cache_memory:
                budget = min(budget, self.config.kv_cache_memory)
            num_blocks = num_blocks_for_budget(budget, self.bytes_per_block)
            group = self.tensor_parallel.group
            return group.all_reduce_min(num_blocks) if group is not None else num_blocks
        return num_blocks_for_budget(self._profile_free_gpu_memory(), self.bytes_per_block)

    def _allocate_kv_cache(self, num_blocks: int) -> torch.Tensor:
        shape = self.shape
        return allocate_kv_cache(
            num_blocks,
            len(self.model.layers),
            self.block_size,
            self.model.local.num_kv_heads,
            shape.head_dim,
            self.dtype,
            self.device,
            self.config.kv_cache_dtype,
        )

    def _profile_free_gpu_memory(self) -> int:
        """Memory left for KV after the weights and the activations of the largest step.

        Runs one forward pass of ``max_num_batched_tokens`` tokens against a scratch
        cache just big enough for it and measures the peak.
        """
        num_tokens = self.config.max_num_batched_tokens
        num_blocks = cdiv(num_tokens, self.block_size)
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
        layer_caches = layer_views(scratch, self.config.kv_cache_dtype)
        self.model(positions % self.shape.vocab_size, positions, layer_caches, metadata, positions[-1:])
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

    def dispatch(self, output: SchedulerOutput) -> PendingStep:
        """Start a scheduled step. Under pipeline parallelism its inputs go to every rank now,
        so the stages before the last start on it, and :meth:`complete` runs the last stage
        and samples: between the two the engine may dispatch the next batch, which the first
        stages then compute while this process computes this one. Otherwise nothing runs
        until :meth:`complete`."""
        if self.tensor_parallel is None or self.tensor_parallel.inbound is None:
            return PendingStep(output)
        batch = self._prepare_inputs(output)
        self.tensor_parallel.send_step(batch)
        return PendingStep(output, batch)

    def complete(self, pending: PendingStep, eos_token_ids: frozenset[int]) -> ModelOutput:
        """Finish a dispatched step (in dispatch order): a sampled token per request that samples."""
        if pending.batch is None:
            return self.execute(pending.output, eos_token_ids)
        return self._run(pending.output, eos_token_ids, pending.batch)

    def execute(self, output: SchedulerOutput, eos_token_ids: frozenset[int]) -> ModelOutput:
        """Run one scheduled step; returns a sampled token per request that samples. Under
        pipeline parallelism it is dispatched and completed at once."""
        if self.tensor_parallel is not None and self.tensor_parallel.inbound is not None:
            return self.complete(self.dispatch(output), eos_token_ids)
        return self._run(output, eos_token_ids, None)

    def _run(self, output: SchedulerOutput, eos_token_ids: frozenset[int], dispatched: FlatBatch | None) -> ModelOutput:
        """The step's forward pass, sampling and drafts; ``dispatched``: its inputs, already sent
        to the pipeline's stages (None: built here)."""
        draft_probs: dict[str, torch.Tensor] = {}
        if output.num_spec_decodes and self.draft_model is not None:
            draft_probs = self.draft_model.propose(output)  # fills the drafts' spec_token_ids
        batch = dispatched if dispatched is not None else self._prepare_inputs(output)
        sampling = [s.request for s in output.scheduled if s.samples]
        # Grammar masks for this step's tokens are computed while the forward pass runs.
        bitmask = self._start_bitmask(sampling)
        # Medusa drafts from the final hidden state of every row that yields logits.
        hidden = None
        if self.medusa is not None:
            hidden = torch.empty(
                len(batch.logits_indices), self.shape.hidden_size, dtype=self.dtype, device=self.device
            )
        if self.eagle is not None:
            logits, hidden = self.eagle.target_forward(batch, self._forward, self.layer_caches)
        else:
            logits = self._forward(batch, hidden)
        if not sampling:
            if self.eagle is not None and hidden is not None:
                self.eagle.propose(output, None, hidden)  # prompt chunks: the draft's KV grows
            return ModelOutput(sampled_token_ids=[], logprobs=[])
        model_output = self._sample(output, logits, sampling, eos_token_ids, draft_probs, bitmask)
        # A batch this large turns speculation down (SpeculativeConfig.disable_by_batch_size):
        # no chain for the next step, which would verify none of it.
        chain = self.speculative is None or self.speculative.speculates_at(len(output.scheduled))
        if self.medusa is not None and hidden is not None:
            model_output.draft_token_ids = (
                self.medusa.propose(output, model_output, hidden) if chain else [[] for _ in sampling]
            )
        if self.eagle is not None and hidden is not None:
            model_output.draft_token_ids = self.eagle.propose(output, model_output, hidden, chain)
        return model_output

    def _sample(
        self,
        output: SchedulerOutput,
        logits: torch.Tensor,
        sampling: list[Request],
        eos_token_ids: frozenset[int],
        draft_probs: dict[str, torch.Tensor],
        bitmask: PendingBitmask | None,
    ) -> ModelOutput:
        if output.num_spec_decodes:
            return self._verify(output, logits, eos_token_ids, draft_probs, bitmask)
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

    def _forward(self, batch: FlatBatch, final_hidden_out: torch.Tensor | None = None) -> torch.Tensor:
        """Float32 logits of the batch's ``logits_indices`` rows; their final hidden states into
        ``final_hidden_out`` if given."""
        if self.tensor_parallel is not None:
            if self.tensor_parallel.inbound is not None:  # the last pipeline stage: dispatch started the others
                return self.tensor_parallel.last_stage_logits(self.model, batch, self.layer_caches)
            self.tensor_parallel.send_step(batch)  # the other ranks run the same step beside this one
        if self.native_decode is not None:
            logits = self.native_decode(batch, final_hidden_out)
            if logits is not None:
                return logits
        return self.model(
            batch.input_ids, batch.positions, self.layer_caches, batch.metadata, batch.logits_indices, final_hidden_out
        )

    def _start_bitmask(self, sampling: list[Request]) -> PendingBitmask | None:
        """None (and no cost beyond one pass over the rows) when no row samples under a grammar."""
        rows = [i for i, r in enumerate(sampling) if r.grammar is not None]
        if not rows or self.structured_output is None:
            return None
        return self.structured_output.worker.start(rows, [sampling[i].grammar for i in rows])

    def _prepare_inputs(self, output: SchedulerOutput) -> FlatBatch:
        scheduled = output.scheduled
        if output.num_spec_decodes:
            return self._prepare_spec_inputs(output)
        num_seqs = len(scheduled)
        # Token ids: one per decode, a slice per prefill chunk.
        input_ids: list[int] = []
        for s in scheduled:
            start = s.request.num_computed_tokens
            input_ids.extend(s.request.all_token_ids[start : start + s.num_new_tokens])
        return build_flat_batch(
            input_ids,
            np.fromiter((s.num_new_tokens for s in scheduled), dtype=np.int64, count=num_seqs),
            np.fromiter((s.request.num_computed_tokens for s in scheduled), dtype=np.int64, count=num_seqs),
            [s.block_ids for s in scheduled],
            np.fromiter((s.samples for s in scheduled), dtype=bool, count=num_seqs),
            output.num_decodes,
            self.block_size,
            self.to_device,
        )

    def _prepare_spec_inputs(self, output: SchedulerOutput) -> FlatBatch:
        """A step in which requests verify drafts: each of their tokens (last known token, then
        the drafts) attends as a decode row of its own, over the context up to itself, and
        yields logits. Attention reads the paged cache after every new token's K/V is stored,
        so this is exactly causal attention over the query, and it runs on the decode kernels
        (on CPU, the native paged kernel reads the blocks in place; a multi-token query would
        go through the prefill path, which gathers the whole context per layer)."""
        input_ids: list[int] = []
        num_new: list[int] = []
        num_computed: list[int] = []
        block_id_rows: list[list[int]] = []
        wants_logits: list[bool] = []
        for s in output.scheduled:
            request, start = s.request, s.request.num_computed_tokens
            if s.num_draft_tokens:
                input_ids.append(request.all_token_ids[start])
                input_ids.extend(request.spec_token_ids[: s.num_draft_tokens])
                num_rows = s.num_draft_tokens + 1
                num_new.extend([1] * num_rows)
                num_computed.extend(range(start, start + num_rows))
                block_id_rows.extend([s.block_ids] * num_rows)
                wants_logits.extend([True] * num_rows)
            else:
                input_ids.extend(request.all_token_ids[start : start + s.num_new_tokens])
                num_new.append(s.num_new_tokens)
                num_computed.append(start)
                block_id_rows.append(s.block_ids)
                wants_logits.append(s.samples)
        return build_flat_batch(
            input_ids,
            np.asarray(num_new, dtype=np.int64),
            np.asarray(num_computed, dtype=np.int64),
            block_id_rows,
            np.asarray(wants_logits, dtype=bool),
            output.num_decodes + output.num_spec_tokens,
            self.block_size,
            self.to_device,
        )

    def _verify(
        self,
        output: SchedulerOutput,
        logits: torch.Tensor,
        eos_token_ids: frozenset[int],
        draft_probs: dict[str, torch.Tensor],
        bitmask: PendingBitmask | None,
    ) -> ModelOutput:
        """Sample a step in which requests verify drafts: one logits row per draft position
        (and the last), each row sampling as if the drafts before it were output already.
        Requests under a grammar never draft: their one row keeps its mask."""
        params, prompts, outputs, generators = [], [], [], []
        first_rows: list[int] = []  # each sampling request's first logits row
        drafts: list[list[int]] = []
        probs: list[torch.Tensor | None] = []
        for s in output.scheduled:
            if not s.samples:
                continue
            request = s.request
            request_drafts = request.spec_token_ids[: s.num_draft_tokens] if s.num_draft_tokens else []
            output_ids = request.output_token_ids
            first_rows.append(len(params))
            for j in range(len(request_drafts) + 1):
                params.append(request.sampling_params)
                prompts.append(request.prompt_token_ids)
                outputs.append(output_ids + request_drafts[:j] if j else output_ids)
                generators.append(request.generator)
            drafts.append(request_drafts)
            probs.append(draft_probs.get(request.request_id))
        verified = self.rejection_sampler(
            logits,
            SamplingMetadata(
                params,
                prompts,
                outputs,
                generators,
                eos_token_ids,
                grammar_rows=[first_rows[i] for i in bitmask.rows] if bitmask else [],
                grammar_bias=bitmask.result() if bitmask else None,
            ),
            drafts,
            probs if draft_probs else None,
        )
        return ModelOutput(
            sampled_token_ids=verified.token_ids,
            logprobs=verified.logprobs,
            accepted_token_ids=verified.accepted_token_ids,
            accepted_logprobs=verified.accepted_logprobs,
        )

    def close(self) -> None:
        """Stop the tensor-parallel workers, if any (idempotent)."""
        if self.tensor_parallel is not None:
            self.tensor_parallel.close()

    def to_device(self, array: np.ndarray) -> torch.Tensor:
        """A host array as a tensor on the model's device (on CPU, the same memory)."""
        tensor = torch.from_numpy(array)
        return tensor if self.device.type == "cpu" else tensor.to(self.device, non_blocking=True)
