"""Medusa heads trained by self-distillation on a tiny checkpoint taught to continue a cycle of
tokens (a deterministic toy corpus: a random checkpoint's continuations are noise no head could
learn): after a hundred steps on its own greedy continuations the heads get far more
drafts accepted on other prompts than untrained heads (the target's own next-token guess, wrong
at every offset on a cycle), greedy output still equals the output without speculation, and an
interrupted run resumes to exactly the heads of an uninterrupted one."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from engine.llm import LLM
from engine.spec_decode.config import SpeculativeConfig
from engine.spec_decode.medusa_checkpoint import save_medusa_heads
from engine.spec_decode.medusa_training import (
    HeadTraining,
    make_training_data,
    new_heads,
    served_lm_head_weight,
    train_heads,
)
from tests.checkpoints import VOCAB_SIZE
from tests.engine.spec_decode.medusa_heads import cycle_snippet, make_cycling_checkpoint
from tests.engine.spec_decode.test_engine_spec import GREEDY, generate, make_engine

SETTINGS = HeadTraining(
    num_heads=3, max_new_tokens=40, prompts_per_shard=16, num_steps=100, batch_size=64, learning_rate=1e-2
)


@pytest.fixture(scope="module")
def target_and_cycle(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[int]]:
    return make_cycling_checkpoint(tmp_path_factory.mktemp("target"))


@pytest.fixture(scope="module")
def target(target_and_cycle: tuple[Path, list[int]]) -> Path:
    return target_and_cycle[0]


@pytest.fixture(scope="module")
def prompts(target_and_cycle: tuple[Path, list[int]]) -> dict[str, list[list[int]]]:
    """Snippets of the cycle: 48 to train on (lengths 4 to 9), 8 others (lengths 10 to 13)."""
    cycle = target_and_cycle[1]
    return {
        "train": [cycle_snippet(cycle, start, 4 + start % 6) for start in range(48)],
        "unseen": [cycle_snippet(cycle, 3 * start + 1, 10 + start % 4) for start in range(8)],
    }


@pytest.fixture(scope="module")
def llm(target: Path) -> LLM:
    return LLM(model=str(target), dtype="float32", kv_cache_memory=1 << 22)


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory, llm: LLM, prompts: dict[str, list[list[int]]]) -> Path:
    """A work folder holding the corpus's shards (made once for the module)."""
    work = tmp_path_factory.mktemp("work")
    make_training_data(llm, prompts["train"], SETTINGS, work)
    return work


def _acceptance(target: Path, heads: Path, prompts: list[list[int]]) -> tuple[float, list[list[int]]]:
    core = make_engine(target, SpeculativeConfig(method="medusa", model=str(heads), num_speculative_tokens=3))
    tokens = generate(core, prompts, [GREEDY] * len(prompts))  # every block back, checked inside
    stats = core.scheduler.spec_stats
    return stats.num_accepted_tokens / stats.num_draft_tokens, tokens


def test_trained_heads_beat_untrained_ones_and_keep_greedy_output(
    target: Path, llm: LLM, work: Path, prompts: dict[str, list[list[int]]], tmp_path: Path
) -> None:
    data = make_training_data(llm, prompts["train"], SETTINGS, work)
    lm_head = served_lm_head_weight(llm)
    heads, heldout = train_heads(data, lm_head, SETTINGS, tmp_path / "state")
    save_medusa_heads(heads, tmp_path / "trained", VOCAB_SIZE, {})
    save_medusa_heads(new_heads(SETTINGS, lm_head.shape[1], VOCAB_SIZE), tmp_path / "untrained", VOCAB_SIZE, {})

    trained, trained_tokens = _acceptance(target, tmp_path / "trained", prompts["unseen"])
    untrained, _ = _acceptance(target, tmp_path / "untrained", prompts["unseen"])
    plain = generate(make_engine(target), prompts["unseen"], [GREEDY] * len(prompts["unseen"]))
    assert trained_tokens == plain
    assert trained > untrained + 0.5, (trained, untrained)
    # The held-out estimate agrees: on a cycle every head can be right.
    assert min(heldout.top1_accuracy) > 0.9 and heldout.mean_accepted_drafts > 2.5, heldout


def test_an_interrupted_run_resumes_to_the_same_heads(
    llm: LLM, work: Path, prompts: dict[str, list[list[int]]], tmp_path: Path
) -> None:
    settings = dataclasses.replace(SETTINGS, num_steps=40, checkpoint_every=10)
    data = make_training_data(llm, prompts["train"], settings, work)
    lm_head = served_lm_head_weight(llm)
    whole, _ = train_heads(data, lm_head, settings, tmp_path / "whole")
    train_heads(data, lm_head, dataclasses.replace(settings, num_steps=20), tmp_path / "halves")
    resumed, _ = train_heads(data, lm_head, settings, tmp_path / "halves")
    assert whole.state_dict().keys() == resumed.state_dict().keys()
    for name, tensor in whole.state_dict().items():
        assert torch.equal(tensor, resumed.state_dict()[name]), name
    assert not torch.equal(whole.blocks[0].layers[0].weight, torch.zeros_like(whole.blocks[0].layers[0].weight))


def test_made_shards_are_read_back_not_made_again(llm: LLM, work: Path, prompts: dict[str, list[list[int]]]) -> None:
    shards = sorted(work.glob("data-*.safetensors"))
    assert len(shards) == 3  # 48 prompts, 16 a shard
    stamps = [path.stat().st_mtime_ns for path in shards]
    again = make_training_data(llm, prompts["train"], SETTINGS, work)
    assert [path.stat().st_mtime_ns for path in shards] == stamps
    assert again.hidden.shape == (again.targets.shape[0], 64) and again.targets.shape[1] == SETTINGS.num_heads


def test_shards_of_other_prompts_or_settings_are_made_anew_not_read_back(
    llm: LLM, tmp_path: Path, prompts: dict[str, list[list[int]]]
) -> None:
    """Reruns over a changed prompt set, or with other settings, in the same work folder."""
    first_shard = prompts["train"][:16]
    made = make_training_data(llm, first_shard, SETTINGS, tmp_path)
    assert torch.equal(make_training_data(llm, first_shard, SETTINGS, tmp_path).hidden, made.hidden)
    assert len(list(tmp_path.glob("data-*.safetensors"))) == 1
    shorter = dataclasses.replace(SETTINGS, max_new_tokens=SETTINGS.max_new_tokens // 2)
    remade = make_training_data(llm, first_shard, shorter, tmp_path)
    fewer_heads = dataclasses.replace(SETTINGS, num_heads=SETTINGS.num_heads - 1)
    other_prompts = make_training_data(llm, [prompts["unseen"][0], *first_shard[1:]], fewer_heads, tmp_path)
    assert len(list(tmp_path.glob("data-*.safetensors"))) == 3
    assert remade.hidden.shape[0] < made.hidden.shape[0]
    assert other_prompts.targets.shape[1] == SETTINGS.num_heads - 1
