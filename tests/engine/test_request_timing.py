"""The timestamps the engine keeps per request (engine/request_timing.py), from which the
services build the phases of its TTFT and its trace spans: a prefill records each prompt
chunk and the step that sampled its first token; a hand-off records its load; every output
carries the step that made it; the engine itself never imports OpenTelemetry."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from engine.config import EngineConfig
from engine.engine_core import EngineCore
from engine.outputs import EngineCoreOutput
from engine.sampling_params import SamplingParams
from tests.checkpoints import make_checkpoint, random_prompts
from tests.engine.kv_loaders import InProcessKVLoader

ENGINE = Path(__file__).resolve().parents[2] / "engine"
GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
CHUNK = 16  # long_prefill_token_threshold: a 40-token prompt prefills in 16 + 16 + 8


@pytest.fixture(scope="module")
def model_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("llama"))


def engine(model_path: Path, role: str, **config: object) -> EngineCore:
    return EngineCore(EngineConfig(model=str(model_path), kv_cache_memory=1 << 22, role=role, **config))  # type: ignore[arg-type]


def run(core: EngineCore, request_id: str) -> list[EngineCoreOutput]:
    outputs = []
    while core.has_unfinished_requests():
        outputs.extend(o for o in core.step() if o.request_id == request_id)
    return outputs


def test_a_prefill_records_each_prompt_chunk_and_the_step_of_its_first_token(model_path: Path) -> None:
    p = engine(model_path, "prefill", long_prefill_token_threshold=CHUNK)
    (prompt,) = random_prompts([40], seed=3)
    p.add_request(prompt, GREEDY, request_id="r")
    (output,) = run(p, "r")
    timing = output.timing
    assert timing is not None
    assert [chunk.num_tokens for chunk in timing.prompt_chunks] == [16, 16, 8]
    assert timing.first_scheduled_at is not None and timing.first_scheduled_at >= timing.added_at
    starts = [chunk.started_at for chunk in timing.prompt_chunks]
    assert timing.first_scheduled_at <= starts[0]
    for earlier, later in zip(timing.prompt_chunks, timing.prompt_chunks[1:]):
        assert earlier.started_at < earlier.ended_at <= later.started_at
    # The last chunk's step sampled the first token.
    last = timing.prompt_chunks[-1]
    assert (timing.first_token_step_started_at, timing.first_token_at) == (last.started_at, last.ended_at)
    assert timing.kv_load_started_at is None and timing.kv_loaded_at is None
    # The output carries its step: what it computed.
    assert output.step is not None and (output.step.started_at, output.step.ended_at) == (
        last.started_at,
        last.ended_at,
    )
    assert (output.step.num_rows, output.step.num_decodes, output.step.num_prefill_tokens) == (1, 0, 8)


def test_a_prefix_cache_hit_computes_only_the_rest_of_the_prompt(model_path: Path) -> None:
    p = engine(model_path, "prefill")
    (prompt,) = random_prompts([40], seed=4)
    p.add_request(prompt, GREEDY, request_id="first")
    run(p, "first")
    p.release_kv("first")
    p.add_request(prompt, GREEDY, request_id="again")
    (output,) = run(p, "again")
    assert output.timing is not None
    assert [chunk.num_tokens for chunk in output.timing.prompt_chunks] == [40 - 32]  # two cached blocks of 16


def test_a_hand_off_records_its_load_then_its_first_decode_step(model_path: Path) -> None:
    p = engine(model_path, "prefill")
    d = engine(model_path, "decode")
    loader = InProcessKVLoader(p.runner.kv_cache, d.runner.kv_cache)
    d.use_kv_loader(loader)
    (prompt,) = random_prompts([33], seed=5)
    p.add_request(prompt, GREEDY, request_id="r")
    (prefilled,) = run(p, "r")
    assert prefilled.kv_handoff is not None
    loader.expect("r", prefilled.kv_handoff.block_ids)
    d.add_request(prompt, GREEDY, request_id="r", first_token_id=prefilled.new_token_ids[0])
    outputs = run(d, "r")
    timing = outputs[0].timing
    assert timing is not None and timing is outputs[-1].timing  # the engine's one record, shared
    assert timing.kv_load_started_at is not None and timing.kv_loaded_at is not None
    assert timing.first_token_step_started_at is not None and timing.first_token_at is not None
    assert timing.added_at <= timing.kv_load_started_at <= timing.kv_loaded_at
    assert timing.kv_loaded_at <= timing.first_token_step_started_at < timing.first_token_at
    assert timing.prompt_chunks == []  # loaded, not computed
    # Its first token's step took the finished load in, then decoded it alone.
    step = outputs[0].step
    assert step is not None and (step.started_at, step.ended_at) == (
        timing.first_token_step_started_at,
        timing.first_token_at,
    )
    assert (step.num_rows, step.num_decodes, step.num_prefill_tokens, step.num_loads_finished) == (1, 1, 0, 1)


def test_the_engine_never_imports_opentelemetry() -> None:
    found = []
    for path in ENGINE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = (
                [alias.name for alias in node.names]
                if isinstance(node, ast.Import)
                else [node.module or ""]
                if isinstance(node, ast.ImportFrom)
                else []
            )
            found += [f"{path.relative_to(ENGINE)}: {name}" for name in names if name.startswith("opentelemetry")]
    assert not found, found
