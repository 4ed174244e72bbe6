"""Tensor parallelism: the layout's arithmetic, and greedy output at TP 2 and 4 (worker
processes, gloo collectives) equal to TP 1 and to transformers, token for token, on tiny
random checkpoints with 4 and 8 KV heads and with KV heads replicated; a worker that dies
ends the engine instead of hanging it."""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from engine.async_engine import AsyncEngine, EngineDeadError
from engine.config import EngineConfig
from engine.llm import LLM
from engine.sampling_params import SamplingParams
from engine.tensor_parallel.executor import split_cpus
from engine.tensor_parallel.layout import TensorParallelLayout, check_tensor_parallel_size
from engine.tensor_parallel.rank_context import RankContext
from tests.checkpoints import make_checkpoint, random_prompts

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
PROMPTS = random_prompts([5, 17, 33], seed=61)


# ------------------------------------------------------------------ the layout


def layouts(world_size: int, num_heads: int, num_kv_heads: int) -> list[TensorParallelLayout]:
    return [TensorParallelLayout(rank, world_size, num_heads, num_kv_heads, 96, 512) for rank in range(world_size)]


def test_kv_heads_split_evenly_when_the_ranks_are_fewer() -> None:
    ranks = layouts(2, num_heads=8, num_kv_heads=4)
    assert [(r.head_start, r.num_local_heads) for r in ranks] == [(0, 4), (4, 4)]
    assert [list(r.kv_heads) for r in ranks] == [[0, 1], [2, 3]]
    assert [r.local_intermediate_size for r in ranks] == [48, 48]


def test_kv_heads_are_replicated_when_the_ranks_outnumber_them() -> None:
    """SmolLM2's shape at TP 3 (9 query heads, 3 KV heads) and 4 KV heads over 8 ranks: each
    rank holds one KV head, the one its query heads read."""
    assert [list(r.kv_heads) for r in layouts(3, num_heads=9, num_kv_heads=3)] == [[0], [1], [2]]
    eight = [TensorParallelLayout(rank, 8, 8, 4, 128, 512) for rank in range(8)]
    assert [r.kv_head_start for r in eight] == [0, 0, 1, 1, 2, 2, 3, 3]
    group_size = 8 // 4  # query heads per KV head
    assert all(r.head_start // group_size == r.kv_head_start for r in eight)


def test_the_vocabulary_shards_are_equal_and_the_last_one_is_padded() -> None:
    ranks = [TensorParallelLayout(rank, 3, 9, 3, 96, 500) for rank in range(3)]
    assert [(r.vocab_start, r.local_vocab_size) for r in ranks] == [(0, 167), (167, 167), (334, 167)]


@pytest.mark.parametrize(
    ("world_size", "num_heads", "num_kv_heads", "intermediate", "message"),
    [
        (2, 9, 3, 96, "does not divide the model's 9 attention heads"),
        (2, 4, 3, 96, "does not divide the model's 3 KV heads"),
        (6, 12, 4, 96, "not a multiple of them"),
        (4, 8, 4, 90, "MLP width 90"),
        (0, 8, 4, 96, "at least 1"),
    ],
)
def test_sizes_that_do_not_split_are_refused_naming_the_counts(
    world_size: int, num_heads: int, num_kv_heads: int, intermediate: int, message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        check_tensor_parallel_size(world_size, num_heads, num_kv_heads, intermediate, 512)


def test_ranks_get_their_own_cpus_when_there_are_enough() -> None:
    assert split_cpus([0, 1, 2, 3], 2) == [{0, 1}, {2, 3}]
    assert split_cpus([0, 1], 4) == [{0}, {1}, {0}, {1}]


# ------------------------------------------------------------------ the engine


@pytest.fixture(scope="module")
def four_kv_heads(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("tp4"), num_attention_heads=8, num_key_value_heads=4)


@pytest.fixture(scope="module")
def eight_kv_heads(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Qwen2: q/k/v biases and tied embeddings, so the LM head's shard comes from the embedding."""
    return make_checkpoint(
        tmp_path_factory.mktemp("tp8"), "Qwen2ForCausalLM", num_attention_heads=8, num_key_value_heads=8
    )


def transformers_greedy(model_path: Path, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    outputs = []
    for prompt in prompts:
        generated = model.generate(
            torch.tensor([prompt]), max_new_tokens=max_tokens, min_new_tokens=max_tokens, do_sample=False
        )
        outputs.append(generated[0, len(prompt) :].tolist())
    return outputs


def greedy(model_path: Path, tensor_parallel_size: int) -> list[list[int]]:
    with LLM(
        model=str(model_path), dtype="float32", kv_cache_memory=1 << 22, tensor_parallel_size=tensor_parallel_size
    ) as llm:
        return [output.outputs[0].token_ids for output in llm.generate(PROMPTS, GREEDY)]


@pytest.mark.parametrize("checkpoint", ["four_kv_heads", "eight_kv_heads"])
@pytest.mark.parametrize("tensor_parallel_size", [2, 4])
def test_greedy_output_equals_tp1_and_transformers(
    request: pytest.FixtureRequest, checkpoint: str, tensor_parallel_size: int
) -> None:
    model_path = request.getfixturevalue(checkpoint)
    expected = transformers_greedy(model_path, PROMPTS, GREEDY.max_tokens)
    assert greedy(model_path, 1) == expected
    assert greedy(model_path, tensor_parallel_size) == expected


def test_kv_heads_replicated_over_more_ranks_than_heads(tmp_path: Path) -> None:
    """Two KV heads over four ranks: each head held by two ranks, the output unchanged."""
    model_path = make_checkpoint(tmp_path, num_attention_heads=4, num_key_value_heads=2)
    assert greedy(model_path, 4) == greedy(model_path, 1)


def test_a_size_the_model_cannot_split_is_refused_before_any_worker_starts(four_kv_heads: Path) -> None:
    with pytest.raises(ValueError, match="does not divide the model's 8 attention heads"):
        LLM(model=str(four_kv_heads), kv_cache_memory=1 << 22, tensor_parallel_size=3)


def test_a_worker_that_dies_mid_stream_ends_the_engine_and_leaves_no_process(four_kv_heads: Path) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=900, ignore_eos=True)

    async def main() -> None:
        config = EngineConfig(model=str(four_kv_heads), kv_cache_memory=1 << 22, tensor_parallel_size=2)
        engine = AsyncEngine(config)
        executor = engine.core.runner.tensor_parallel
        assert executor is not None
        ((worker, _),) = executor._workers
        await engine.start()
        try:
            stream = engine.generate(PROMPTS[0], params)
            await anext(stream)
            os.kill(worker.pid, signal.SIGKILL)
            with pytest.raises(EngineDeadError):
                async for _ in stream:
                    pass
            assert engine.error is not None and not engine.is_alive
        finally:
            await engine.stop()
        assert not worker.is_alive()

    asyncio.run(main())


@pytest.mark.slow
def test_smollm2_at_tp3_equals_tp1() -> None:
    """The embedded model: 9 query heads and 3 KV heads, one KV head per rank at TP 3."""
    prompts = ["The capital of France is", "def fibonacci(n):"]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    config = dict(dtype="float32", kv_cache_memory=64 << 20, max_model_len=256)
    with LLM(model=None, **config) as whole:
        expected = [output.outputs[0].token_ids for output in whole.generate(prompts, params)]
    with LLM(model=None, tensor_parallel_size=3, **config) as split:
        assert [output.outputs[0].token_ids for output in split.generate(prompts, params)] == expected


def report_rank(context: RankContext) -> None:
    """A worker extension: says where it runs and what it holds, then returns at once."""
    shape = ",".join(str(n) for n in context.kv_cache.shape)
    context.channel.send_bytes(f"{context.rank}/{context.world_size} heads {list(context.kv_heads)} {shape}".encode())


def test_a_worker_extension_runs_in_every_worker_beside_its_kv_cache(four_kv_heads: Path) -> None:
    with LLM(
        model=str(four_kv_heads), kv_cache_memory=1 << 22, tensor_parallel_size=4, worker_extension=report_rank
    ) as llm:
        executor = llm.engine.runner.tensor_parallel
        assert executor is not None
        num_blocks = llm.engine.runner.num_blocks
        said = [channel.recv_bytes().decode() for channel in executor.extension_channels]
        # Ranks 1..3 of 4, one KV head each of the model's 4, 2 layers, block size 16, head dim 8.
        assert said == [f"{rank}/4 heads [{rank}] {num_blocks},2,2,16,1,8" for rank in (1, 2, 3)]
