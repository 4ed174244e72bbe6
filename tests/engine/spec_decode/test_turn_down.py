"""Speculation turned down by the batch (``disable_by_batch_size``): a step of that many requests
or more verifies no draft, and after-step drafters (Medusa, EAGLE-3) run no chain for it; once the
batch is smaller again drafts come back; greedy output stays the plain engine's throughout, and
every block comes back (``generate`` checks)."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.engine_core import EngineCore
from engine.sampling_params import SamplingParams
from engine.scheduler_output import SchedulerOutput
from engine.spec_decode.config import SpeculativeConfig
from engine_args.config import speculative_config_from_json
from tests.checkpoints import make_checkpoint
from tests.engine.spec_decode.eagle3_drafts import NUM_TARGET_LAYERS, make_eagle3_draft
from tests.engine.spec_decode.medusa_heads import make_medusa_heads
from tests.engine.spec_decode.test_engine_spec import generate, make_engine, repetitive_prompts

LIMIT = 3


@pytest.fixture(scope="module")
def target(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("target"), num_hidden_layers=NUM_TARGET_LAYERS)


def speculative(method: str, folder: Path) -> SpeculativeConfig:
    if method == "ngram":
        return SpeculativeConfig(
            method="ngram", num_speculative_tokens=3, ngram_min=1, ngram_max=3, disable_by_batch_size=LIMIT
        )
    if method == "medusa":
        heads = make_medusa_heads(folder / "heads", "vllm")
        return SpeculativeConfig(
            method="medusa", model=str(heads), num_speculative_tokens=3, disable_by_batch_size=LIMIT
        )
    draft = make_eagle3_draft(folder / "draft", "speculators")
    return SpeculativeConfig(method="eagle3", model=str(draft), num_speculative_tokens=3, disable_by_batch_size=LIMIT)


def record_steps(core: EngineCore) -> list[tuple[int, int, int]]:
    """Per step the engine runs: (requests in it, drafts it verifies, requests whose EAGLE draft
    KV is kept after it)."""
    steps: list[tuple[int, int, int]] = []
    execute = core.runner.execute
    eagle = core.runner.eagle

    def recording(output: SchedulerOutput, eos_token_ids: frozenset[int]):  # type: ignore[no-untyped-def]
        model_output = execute(output, eos_token_ids)
        held = eagle.num_requests_held if eagle is not None else 0
        steps.append((len(output.scheduled), sum(s.num_draft_tokens for s in output.scheduled), held))
        return model_output

    core.runner.execute = recording  # type: ignore[method-assign]
    return steps


@pytest.mark.parametrize("method", ["ngram", "medusa", "eagle3"])
def test_a_batch_at_the_limit_verifies_no_draft_and_a_smaller_one_speculates_again(
    target: Path, tmp_path: Path, method: str
) -> None:
    spec = speculative(method, tmp_path)
    prompts = repetitive_prompts()  # four requests: at the limit of three until two have finished
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (6, 10, 40, 40)]
    core = make_engine(target, spec)
    steps = record_steps(core)
    assert generate(core, prompts, params) == generate(make_engine(target), prompts, params)
    at_limit = [drafts for requests, drafts, _ in steps if requests >= LIMIT]
    below = [drafts for requests, drafts, _ in steps if requests < LIMIT]
    assert at_limit and not any(at_limit), steps
    assert sum(below) > 0, steps
    if method != "ngram":
        # The after-step drafters ran no chain for a large batch's next step: the first step below
        # the limit has nothing to verify yet, as after a prompt.
        first_below = next(i for i, (requests, _, _) in enumerate(steps) if requests < LIMIT)
        assert steps[first_below][1] == 0, steps
    if method == "eagle3":
        # No draft KV kept up while turned down (its upkeep is a draft pass a step); one again after.
        assert not any(held for requests, _, held in steps if requests >= LIMIT), steps
        assert any(held for requests, _, held in steps if requests < LIMIT), steps


def test_the_limit_is_read_as_vllm_spells_it_and_checked() -> None:
    config = speculative_config_from_json('{"method": "ngram", "disable_by_batch_size": 4}')
    assert config.disable_by_batch_size == 4
    assert config.speculates_at(3) and not config.speculates_at(4)
    assert SpeculativeConfig(method="ngram").speculates_at(1_000)
    with pytest.raises(ValueError, match="disable_by_batch_size must be at least 2"):
        speculative_config_from_json('{"method": "ngram", "disable_by_batch_size": 1}')
