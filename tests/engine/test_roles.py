"""Prefill and decode roles with the KV copied between two engines in-process
(the KV connector's job, done here by hand): the output equals the colocated engine's."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.config import EngineConfig
from engine.engine_core import EngineCore
from engine.llm import LLM
from engine.outputs import EngineCoreOutput
from engine.sampling_params import SamplingParams
from tests.checkpoints import make_checkpoint, random_prompts
from tests.engine.kv_loaders import InProcessKVLoader

GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)


@pytest.fixture(scope="module")
def model_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("llama"))


def engine(model_path: Path, role: str) -> EngineCore:
    return EngineCore(EngineConfig(model=str(model_path), kv_cache_memory=1 << 22, role=role))  # type: ignore[arg-type]


def decode_engine_loading_from(model_path: Path, p: EngineCore) -> tuple[EngineCore, InProcessKVLoader]:
    d = engine(model_path, "decode")
    loader = InProcessKVLoader(p.runner.kv_cache, d.runner.kv_cache)
    d.use_kv_loader(loader)
    return d, loader


def run_until_finished(core: EngineCore, request_id: str) -> list[EngineCoreOutput]:
    outputs = []
    while core.has_unfinished_requests():
        outputs.extend(o for o in core.step() if o.request_id == request_id)
    return outputs


def prefill(core: EngineCore, prompt: list[int], request_id: str) -> EngineCoreOutput:
    core.add_request(prompt, GREEDY, request_id=request_id)
    (output,) = run_until_finished(core, request_id)
    assert output.kv_handoff is not None
    return output


def assert_all_free(*cores: EngineCore) -> None:
    for core in cores:
        report = core.load_report()
        assert report.num_free_blocks == report.num_total_blocks


@pytest.mark.parametrize("pull_succeeds", [True, False], ids=["pulled", "recomputed"])
def test_prefill_to_decode_matches_colocated(model_path: Path, pull_succeeds: bool) -> None:
    prompts = random_prompts([5, 16, 33, 47], seed=11)
    expected = [o.outputs[0].token_ids for o in LLM(model=str(model_path)).generate(prompts, GREEDY)]
    p = engine(model_path, "prefill")
    d, loader = decode_engine_loading_from(model_path, p)
    for index, prompt in enumerate(prompts):
        request_id = f"r{index}"
        handoff_output = prefill(p, prompt, request_id)
        first_token = handoff_output.new_token_ids[0]
        loader.expect(request_id, handoff_output.kv_handoff.block_ids if pull_succeeds else None)
        d.add_request(prompt, GREEDY, request_id=request_id, first_token_id=first_token)
        assert d.step() == []  # the load starts; its result is polled at the next step
        assert p.release_kv(request_id)
        tokens = [first_token]
        for output in run_until_finished(d, request_id):
            tokens.extend(output.new_token_ids)
        assert tokens == expected[index]
    assert_all_free(p, d)


def test_decode_prefix_hit_pulls_fewer_blocks(model_path: Path) -> None:
    p = engine(model_path, "prefill")
    d, loader = decode_engine_loading_from(model_path, p)
    shared = random_prompts([32], seed=12)[0]
    for index, suffix in enumerate(random_prompts([9, 9], seed=13)):
        prompt = shared + suffix
        handoff_output = prefill(p, prompt, f"r{index}")
        loader.expect(f"r{index}", handoff_output.kv_handoff.block_ids)
        d.add_request(prompt, GREEDY, request_id=f"r{index}", first_token_id=handoff_output.new_token_ids[0])
        p.release_kv(f"r{index}")
        run_until_finished(d, f"r{index}")
    assert [load.num_local_hit_blocks * d.config.block_size for load in loader.started] == [0, 32]
    assert_all_free(p, d)


def test_pinned_prefill_blocks_free_on_abort(model_path: Path) -> None:
    p = engine(model_path, "prefill")
    prefill(p, random_prompts([40], seed=14)[0], "r")
    assert p.load_report().num_free_blocks == p.load_report().num_total_blocks - 3
    p.abort(["r"])
    assert_all_free(p)
    assert not p.release_kv("r")
