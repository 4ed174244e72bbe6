"""Small factories for engine unit tests: requests and schedulers without a model, and
attention caches laid out as the engine lays them out."""

from __future__ import annotations

import torch

from engine.block_pool import BlockPool
from engine.kv_cache_layout import layer_view
from engine.kv_cache_manager import KVCacheManager
from engine.kv_loader import KVLoadFailurePolicy, KVLoadResult
from engine.request import Request
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler
from engine.scheduler_output import ModelOutput, SchedulerOutput
from tests.engine.kv_loaders import ManualKVLoader

EOS = 2
_clock = iter(range(1_000_000))


def make_request(
    request_id: str,
    prompt: list[int] | int,
    max_tokens: int = 4,
    priority: int = 0,
    first_token_id: int | None = None,
    kv_load_failure_policy: KVLoadFailurePolicy = "recompute",
    **params: object,
) -> Request:
    """``prompt`` is the token ids, or a length (tokens 10, 11, ... then). ``first_token_id``
    makes it a hand-off: its prompt's KV is loaded, not computed."""
    token_ids = list(range(10, 10 + prompt)) if isinstance(prompt, int) else list(prompt)
    request = Request(
        request_id=request_id,
        prompt_token_ids=token_ids,
        sampling_params=SamplingParams(max_tokens=max_tokens, **params),
        max_tokens=max_tokens,
        eos_token_ids=frozenset({EOS}),
        priority=priority,
        arrival_time=float(next(_clock)),  # strictly increasing: arrival order is creation order
    )
    if first_token_id is not None:
        request.append_token(first_token_id)
        request.num_external_tokens = len(token_ids)
        request.kv_load_failure_policy = kv_load_failure_policy
    return request


def make_scheduler(
    num_blocks: int = 16,
    block_size: int = 4,
    max_num_seqs: int = 8,
    max_num_batched_tokens: int = 64,
    max_model_len: int = 64,
    role: str = "colocated",
    enable_prefix_caching: bool = True,
    max_num_prefill_tokens: int | None = None,
    speculative: bool = False,
    long_prefill_token_threshold: int | None = None,
    max_batches_in_flight: int = 1,
) -> Scheduler:
    """A decode-role scheduler comes with a :class:`~tests.engine.kv_loaders.ManualKVLoader`."""
    manager = KVCacheManager(num_blocks, block_size, enable_prefix_caching)
    scheduler = Scheduler(
        manager,
        max_num_seqs,
        max_num_batched_tokens,
        max_model_len,
        role,  # type: ignore[arg-type]
        max_num_prefill_tokens,
        speculative,
        long_prefill_token_threshold,
        max_batches_in_flight,
    )
    if role == "decode":
        scheduler.kv_loader = ManualKVLoader()
    return scheduler


def finish_load(scheduler: Scheduler, request_id: str, error: str | None = None) -> list[Request]:
    """The load of ``request_id`` ends (loaded when ``error`` is None), and the scheduler gets
    the result as at a step boundary; returns the requests that ended."""
    if not isinstance(scheduler.kv_loader, ManualKVLoader):
        raise TypeError("finish_load drives a scheduler made by make_scheduler(role='decode')")
    ended = scheduler.kv_load_finished(KVLoadResult(request_id, error))
    return [ended] if ended is not None else []


def sample(output: SchedulerOutput, token_id: int = 7) -> ModelOutput:
    """A model output that samples ``token_id`` for every request that samples this step."""
    num_sampling = sum(1 for item in output.scheduled if item.samples)
    return ModelOutput(sampled_token_ids=[token_id] * num_sampling, logprobs=[None] * num_sampling)


def run_step(scheduler: Scheduler, token_id: int = 7) -> SchedulerOutput:
    output = scheduler.schedule()
    scheduler.update(output, sample(output, token_id))
    return output


def in_block_major_cache(layer_cache: torch.Tensor, num_layers: int = 3, layer: int = 1) -> torch.Tensor:
    """``layer_cache`` ([2, num_blocks, block_size, H_kv, D]) copied into layer ``layer`` of a
    block-major cache of ``num_layers`` layers, as the engine hands a layer to attention: blocks
    lie a whole cross-layer block apart. The other layers hold NaN, so a kernel that strays
    into them poisons its output."""
    _, num_blocks, block_size, num_kv_heads, head_dim = layer_cache.shape
    full = torch.full(
        (num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim), float("nan"), dtype=layer_cache.dtype
    )
    view = layer_view(full, layer)
    view.copy_(layer_cache)
    return view


def eviction_order(pool: BlockPool) -> list[int]:
    """The free block ids in the order the pool hands them out, read by taking them one at a
    time (so the pool is left with none free)."""
    return [pool.get_new_blocks(1)[0].block_id for _ in range(pool.num_free_blocks)]
