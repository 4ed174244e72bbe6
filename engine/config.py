"""Engine configuration: what to load, how much KV cache to keep, how to batch."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from engine.default_model import LOAD_FORMATS, LoadFormat
from engine.kv_cache_dtype import KV_CACHE_DTYPES, KVCacheDType
from engine.kv_cache_utils import BlockHasher, PrefixCacheHash
from engine.spec_decode.config import SpeculativeConfig
from engine.tensor_parallel.rank_context import WorkerExtension

EngineRole = Literal["colocated", "prefill", "decode"]
DTypeName = Literal["float32", "bfloat16", "float16", "auto"]
QuantizationName = Literal["int8"]
# How quantized weights' kernels take their inputs (engine/models/quantized_linear.py): "float", as
# they come (the float model of the dequantized weights, up to summation order); "q8", rounded to
# 8-bit blocks on the fly for integer dot products, as llama.cpp computes (faster, not that model).
QuantActivations = Literal["float", "q8"]
QUANT_ACTIVATIONS: tuple[QuantActivations, ...] = ("float", "q8")

DEFAULT_KV_CACHE_MEMORY = 1 << 30  # bytes; enough for ~36k tokens of SmolLM2-135M in bf16


@dataclass(slots=True)
class EngineConfig:
    """Every knob of one engine instance.

    ``kv_cache_memory`` (bytes) sizes the KV cache on CPU (``None``: 1 GiB); on GPU
    the size comes from ``gpu_memory_utilization`` after a profiling forward pass,
    capped by ``kv_cache_memory`` when that is given. ``num_blocks_override`` pins the
    block count outright (tests use it to force preemption).
    """

    model: str | None = None  # None: the embedded default model (SmolLM2-135M-Instruct)
    # Which form of the embedded model (vLLM's --load-format): "gguf", the file as shipped, kept
    # quantized; "safetensors", its dequantized bf16 folder; "auto", by device and dtype
    # (engine/default_model.py). With a model of its own, the form it is, or refused.
    load_format: LoadFormat = "auto"
    # auto: the checkpoint's dtype, except on CPU: bfloat16 checkpoints run in bf16 where the CPU
    # has bf16 dot products (AVX512_BF16, AMX), everything else in float32
    # (engine/models/loader.py: resolve_dtype).
    dtype: DTypeName = "auto"
    # Weights quantized at load (vLLM's --quantization): "int8", per output channel, symmetric,
    # weight-only, from any float checkpoint (engine/models/int8_quantize.py); None: the
    # checkpoint's own weights (a GGUF file's stay in their blocks). dtype stays the compute dtype.
    quantization: QuantizationName | None = None
    # Only where weights are kept quantized (a GGUF file, quantization="int8"); see QuantActivations.
    quant_activations: QuantActivations = "float"
    # How the KV cache stores K and V (vLLM's --kv-cache-dtype; engine/kv_cache_dtype.py): "auto",
    # the compute dtype; "int8" or "fp8_e4m3", 8-bit values with a float32 scale per token and KV
    # head, about half of bf16's bytes in memory and on the wire between prefill and decode.
    kv_cache_dtype: KVCacheDType = "auto"
    device: str = "auto"  # "auto": cuda when available, else cpu
    role: EngineRole = "colocated"
    block_size: int = 16
    kv_cache_memory: int | None = None
    gpu_memory_utilization: float = 0.9
    num_blocks_override: int | None = None
    max_model_len: int | None = None  # None: from the model config
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    # Of that budget, the most prompt (or recompute) tokens one step computes beside its
    # decodes; None: all of it. The decode role caps it so running streams keep their pace.
    max_num_prefill_tokens: int | None = None
    # The most prompt tokens of one request in one step (a long prompt in chunks of this size,
    # so prompts that arrive meanwhile share its steps; vLLM's --long-prefill-token-threshold);
    # "auto": chunks of about half a second at the measured prefill rate (engine/prefill_chunk.py);
    # None: no cap of its own.
    long_prefill_token_threshold: int | Literal["auto"] | None = None
    enable_prefix_caching: bool = True
    # The prefix cache's block hash (engine/kv_cache_utils.py): xxh3, or sha256, collision resistant,
    # HMAC-SHA256 under prefix_cache_hash_key when one is given (instances derive it from the
    # cluster secret, so that the gateway, holding the same secret, computes the same chain);
    # auto: keyed sha256 where there is a key, xxh3 where there is none (``block_hasher``).
    prefix_cache_hash: PrefixCacheHash | Literal["auto"] = "auto"
    prefix_cache_hash_key: bytes | None = field(default=None, repr=False)
    # Ranks the model is split over, one process each (engine/tensor_parallel/); 1: this process alone.
    tensor_parallel_size: int = 1
    # Stages the layers are split into, one process each per tensor-parallel rank
    # (engine/pipeline_parallel/); 1: every layer in each rank.
    pipeline_parallel_size: int = 1
    # Each stage's layer count, in order (None: as equal as the layer count allows).
    pipeline_stage_layers: tuple[int, ...] | None = None
    # Run in every tensor-parallel worker once its KV cache exists (engine/tensor_parallel/rank_context.py);
    # a module-level function, so that it reaches the worker by name.
    worker_extension: WorkerExtension | None = None
    attention_backend: Literal["auto", "torch", "triton"] = "auto"
    seed: int = 0
    # Speculative decoding (engine/spec_decode): None is off, and costs nothing per step.
    speculative: SpeculativeConfig | None = None

    def __post_init__(self) -> None:
        if self.block_size <= 0 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a positive power of two, got {self.block_size}")
        if self.quantization not in (None, "int8"):
            raise ValueError(f"quantization must be int8 or None, got {self.quantization!r}")
        if self.load_format not in LOAD_FORMATS:
            raise ValueError(f"load_format must be one of {', '.join(LOAD_FORMATS)}; got {self.load_format!r}")
        if self.quant_activations not in QUANT_ACTIVATIONS:
            raise ValueError(f"quant_activations must be float or q8, got {self.quant_activations!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}; got {self.kv_cache_dtype!r}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        if self.max_num_prefill_tokens is not None and self.max_num_prefill_tokens < 2:
            raise ValueError(
                f"max_num_prefill_tokens must be >= 2 (or None for no cap), got {self.max_num_prefill_tokens}"
            )
        threshold = self.long_prefill_token_threshold
        if threshold is not None and threshold != "auto" and (not isinstance(threshold, int) or threshold < 2):
            raise ValueError(
                f"long_prefill_token_threshold must be a token count >= 2, 'auto' or None (no cap); got {threshold!r}"
            )
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        self._check_pipeline_parallel()
        if self.tensor_parallel_size > 1 and self.speculative is not None and self.speculative.method != "ngram":
            raise ValueError(
                f"{self.speculative.method} speculation is not supported with --tensor-parallel-size above 1 yet; "
                "use n-gram drafts (--num-speculative-tokens alone), or tensor parallel size 1"
            )
        if self.prefix_cache_hash != "auto":
            BlockHasher(self.prefix_cache_hash)  # a ValueError naming the choices for an unknown one
        if self.role not in ("colocated", "prefill", "decode"):
            raise ValueError(f"role must be one of colocated, prefill, decode; got {self.role!r}")
        if self.speculative is not None and self.speculative.num_speculative_tokens >= self.max_num_batched_tokens:
            raise ValueError(
                f"--num-speculative-tokens ({self.speculative.num_speculative_tokens}) must be below "
                f"max_num_batched_tokens ({self.max_num_batched_tokens}): a step verifies them with the last token"
            )

    @property
    def world_size(self) -> int:
        """Processes the model runs in: one per tensor-parallel rank of each pipeline stage."""
        return self.tensor_parallel_size * self.pipeline_parallel_size

    def _check_pipeline_parallel(self) -> None:
        """What pipeline parallelism does not take yet, refused with the way out. The split
        itself is checked against the model's layers when it loads (engine/pipeline_parallel/stages.py)."""
        size = self.pipeline_parallel_size
        if size < 1:
            raise ValueError(f"pipeline_parallel_size must be >= 1, got {size}")
        if self.pipeline_stage_layers is not None and len(self.pipeline_stage_layers) != size:
            raise ValueError(
                f"--pipeline-stage-layers names {len(self.pipeline_stage_layers)} stages, --pipeline-parallel-size "
                f"is {size}: give one layer count per stage"
            )
        if size == 1:
            return
        if self.speculative is not None and self.speculative.method != "ngram":
            raise ValueError(
                f"{self.speculative.method} speculation is not supported with --pipeline-parallel-size above 1 yet; "
                "use n-gram drafts (--num-speculative-tokens alone), or pipeline parallel size 1"
            )

    @property
    def block_hasher(self) -> BlockHasher:
        """The prefix cache's hash; the key serves sha256 only (xxh3 takes none). ``auto`` is
        keyed sha256 where a cluster secret gave a key: no crafted prompt can then reuse KV
        computed for another, nor can a chain be computed outside the cluster; xxh3, the
        fastest, where there is no key (an offline engine, an instance on an open plane)."""
        if self.prefix_cache_hash == "auto":
            algorithm: PrefixCacheHash = "sha256" if self.prefix_cache_hash_key is not None else "xxh3"
        else:
            algorithm = self.prefix_cache_hash
        return BlockHasher(algorithm, self.prefix_cache_hash_key if algorithm == "sha256" else None)
