"""Teacher-forced logits (engine/teacher_forcing.py): fed the engine's own greedy continuation, the
argmax at every position is the token it generated; the blocks are borrowed from the pool and
given back; a busy engine is refused."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine import LLM, SamplingParams
from engine.teacher_forcing import borrowed_block_rows, teacher_forced_logits
from tests.checkpoints import random_prompts
from tests.engine.test_parity import assert_no_leaks

GEN_TOKENS = 8


@pytest.fixture(scope="module")
def llm(model: Path) -> LLM:
    return LLM(model=str(model), dtype="float32", kv_cache_memory=1 << 22)


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
def test_the_argmax_at_each_position_is_the_engines_greedy_token(model: Path, kv_cache_dtype: str) -> None:
    with LLM(model=str(model), dtype="float32", kv_cache_dtype=kv_cache_dtype, kv_cache_memory=1 << 22) as llm:
        prompts = random_prompts([5, 17, 30], seed=3)
        greedy = SamplingParams(temperature=0.0, max_tokens=GEN_TOKENS, ignore_eos=True)
        continuations = [output.outputs[0].token_ids for output in llm.generate(prompts, greedy)]
        stream = teacher_forced_logits(llm.engine, prompts, continuations)
        for position in range(GEN_TOKENS):
            logits = next(stream)
            assert logits.shape == (len(prompts), llm.engine.vocab_size)
            assert logits.argmax(dim=-1).tolist() == [c[position] for c in continuations]
            assert llm.engine.kv_cache_manager.num_free_blocks < llm.engine.kv_cache_manager.num_total_blocks
        stream.close()
        assert_no_leaks(llm)


def test_blocks_are_borrowed_from_the_pool_and_given_back(llm: LLM) -> None:
    manager = llm.engine.kv_cache_manager
    with borrowed_block_rows(llm.engine, num_rows=2, num_tokens=33) as rows:  # 3 blocks of 16 each
        assert [len(row) for row in rows] == [3, 3] and len({b for row in rows for b in row}) == 6
        assert manager.num_free_blocks == manager.num_total_blocks - 6
    assert_no_leaks(llm)
    too_many = 16 * (manager.num_total_blocks + 1)
    with pytest.raises(ValueError, match="raise kv_cache_memory"), borrowed_block_rows(llm.engine, 1, too_many):
        pass


def test_a_busy_engine_is_refused(llm: LLM) -> None:
    llm.engine.add_request([5, 6, 7], SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match="need an idle engine"), borrowed_block_rows(llm.engine, 1, 4):
        pass
    while llm.engine.has_unfinished_requests():
        llm.engine.step()
    assert_no_leaks(llm)
