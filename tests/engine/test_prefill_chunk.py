"""The "auto" cap on one request's prompt chunk: sized from the measured prefill rate, applied
by the engine at every step."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.config import EngineConfig
from engine.engine_core import EngineCore
from engine.prefill_chunk import AUTO_CHUNK_SECONDS, MIN_AUTO_CHUNK_TOKENS, auto_long_prefill_threshold
from engine.sampling_params import SamplingParams
from tests.checkpoints import make_checkpoint, random_prompts


def test_half_a_second_of_prefill_in_whole_blocks_never_below_the_floor_nor_up_to_the_budget() -> None:
    assert (AUTO_CHUNK_SECONDS, MIN_AUTO_CHUNK_TOKENS) == (0.5, 256)
    assert auto_long_prefill_threshold(0.0, 16, 2048) is None  # not measured yet: no cap
    assert auto_long_prefill_threshold(300.0, 16, 2048) == 256  # one CPU core, float32: the floor
    assert auto_long_prefill_threshold(1000.0, 16, 2048) == 512
    assert auto_long_prefill_threshold(1100.0, 16, 2048) == 560  # 550 tokens: up to whole blocks (35)
    assert auto_long_prefill_threshold(4096.0, 16, 2048) is None  # half a second holds the whole budget
    assert auto_long_prefill_threshold(50_000.0, 16, 2048) is None  # a GPU


@pytest.fixture(scope="module")
def model_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("llama"))


def test_auto_caps_a_prefill_instances_chunks_once_its_rate_is_measured(model_path: Path) -> None:
    core = EngineCore(
        EngineConfig(
            model=str(model_path),
            kv_cache_memory=1 << 22,
            role="prefill",
            max_num_batched_tokens=512,
            max_model_len=1024,
            long_prefill_token_threshold="auto",
        )
    )
    assert core.scheduler.long_prefill_token_threshold is None
    params = SamplingParams(temperature=0.0, max_tokens=1)
    (first, second) = random_prompts([100, 400], seed=3)
    core.add_request(first, params, request_id="first")
    core.step()  # the first measured prefill step
    core.prefill_rate = _Rate(300.0)  # as one CPU core computes SmolLM2-135M in float32
    core.add_request(second, params, request_id="second")
    core.step()
    assert core.scheduler.long_prefill_token_threshold == 256
    assert core.scheduler.requests["second"].num_computed_tokens == 256  # 400 tokens: a chunk of 256 first
    core.prefill_rate = _Rate(50_000.0)
    core.step()
    assert core.scheduler.long_prefill_token_threshold is None
    core.abort(["first", "second"])
    report = core.load_report()
    assert report.num_free_blocks == report.num_total_blocks


class _Rate:
    """A prefill rate that stays where the test puts it (the engine's own one follows the steps)."""

    def __init__(self, tokens_per_s: float) -> None:
        self.tokens_per_s = tokens_per_s

    def add(self, num_tokens: int, seconds: float) -> None:
        pass
