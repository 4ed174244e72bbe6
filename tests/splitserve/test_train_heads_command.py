"""``splitserve train-heads`` at a tiny size: the command trains heads for the tiny checkpoint on
prompts from the shipped text, writes them where the engine reads them, and says what they
were trained on."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
import torch

from engine.spec_decode.medusa_checkpoint import load_medusa_heads
from splitserve.cli import main
from splitserve.train_heads import add_arguments, prompt_texts
from tests.checkpoints import VOCAB_SIZE, make_checkpoint


def test_train_heads_writes_heads_the_engine_loads(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    model = make_checkpoint(tmp_path / "model")
    output = tmp_path / "heads"
    argv = ["train-heads", "--method", "medusa", "--model", str(model), "--dtype", "float32", "--output", str(output)]
    argv += ["--num-prompts", "3", "--max-new-tokens", "6", "--steps", "4", "--batch-size", "8", "--num-heads", "2"]
    assert main(argv) == 0
    config = json.loads((output / "config.json").read_text())
    assert (config["num_heads"], config["original_lm_head"], config["base_model"]) == (2, True, str(model))
    assert config["training"]["num_prompts"] == 3 and "pride_and_prejudice" in config["training"]["prompts"]
    assert config["training"]["num_positions"] == 3 * 5  # each prompt's last token, then 6 outputs but the last
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == config["heldout"]
    heads = load_medusa_heads(output, 64, VOCAB_SIZE, torch.float32, torch.device("cpu"))
    assert heads.num_heads == 2 and len(heads.lm_heads) == 0  # the target's own LM head
    assert (output / "work" / "train_state.pt").is_file()  # a rerun resumes from here


def test_train_heads_eagle_writes_a_draft_the_engine_serves(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from engine.spec_decode.config import SpeculativeConfig
    from engine.spec_decode.eagle_checkpoint import load_eagle_draft, read_eagle_config
    from tests.engine.spec_decode.test_engine_spec import GREEDY, generate, make_engine

    model = make_checkpoint(tmp_path / "model")
    output = tmp_path / "draft"
    argv = ["train-heads", "--method", "eagle", "--model", str(model), "--dtype", "float32", "--output", str(output)]
    argv += ["--num-prompts", "4", "--max-new-tokens", "6", "--steps", "3", "--batch-size", "2"]
    assert main(argv) == 0
    config = json.loads((output / "config.json").read_text())
    assert (config["speculators_model_type"], config["base_model"]) == ("eagle", str(model))
    assert read_eagle_config(output).layout == "speculators"
    assert config["training"]["num_prompts"] == 4 and config["training"]["num_sequences"] == 3  # one held out
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == config["heldout"]
    assert config["heldout"]["num_positions"] > 0
    draft = load_eagle_draft(output, 64, VOCAB_SIZE, 1024, torch.float32, torch.device("cpu"))
    assert draft.embed_tokens is None and draft.lm_head is None  # the target's own
    assert (output / "work" / "eagle_train_state.pt").is_file()  # a rerun resumes from here
    assert [p.name.split("-")[2] for p in (output / "work").glob("eagle-data-*")] == ["00000"]
    prompts = [[5, 6, 7, 8, 9], [40, 41, 42]]
    expected = generate(make_engine(model), prompts, [GREEDY] * 2)
    spec = SpeculativeConfig(method="eagle", model=str(output), num_speculative_tokens=2)
    assert generate(make_engine(model, spec), prompts, [GREEDY] * 2) == expected


def test_train_heads_eagle3_writes_a_draft_the_engine_serves(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from engine.spec_decode.config import SpeculativeConfig
    from engine.spec_decode.eagle3_checkpoint import load_eagle3_draft, read_eagle3_config
    from tests.engine.spec_decode.test_engine_spec import GREEDY, generate, make_engine

    model = make_checkpoint(tmp_path / "model", num_hidden_layers=8)  # EAGLE-3's layers 2, 4 and 5
    output = tmp_path / "draft"
    argv = ["train-heads", "--method", "eagle3", "--model", str(model), "--dtype", "float32", "--output", str(output)]
    argv += ["--num-prompts", "4", "--max-new-tokens", "6", "--steps", "3", "--batch-size", "2"]
    argv += ["--draft-vocab-size", "20"]
    assert main(argv) == 0
    config = json.loads((output / "config.json").read_text())
    assert (config["speculators_model_type"], config["base_model"]) == ("eagle3", str(model))
    assert read_eagle3_config(output).layout == "speculators"
    assert config["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5] and config["draft_vocab_size"] <= 20
    assert config["training"]["num_prompts"] == 4 and config["training"]["num_sequences"] == 3  # one held out
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == config["heldout"]
    assert config["heldout"]["num_positions"] > 0
    draft = load_eagle3_draft(output, 64, VOCAB_SIZE, 8, 1024, torch.float32, torch.device("cpu"))
    assert draft.embed_tokens is None and draft.lm_head.weight.shape[0] == config["draft_vocab_size"]
    assert (output / "work" / "eagle3_train_state.pt").is_file()  # a rerun resumes from here
    prompts = [[5, 6, 7, 8, 9], [40, 41, 42]]
    expected = generate(make_engine(model), prompts, [GREEDY] * 2)
    spec = SpeculativeConfig(method="eagle3", model=str(output), num_speculative_tokens=2)
    assert generate(make_engine(model, spec), prompts, [GREEDY] * 2) == expected


def test_the_questions_benchmarks_call_unseen_are_not_among_the_training_prompts() -> None:
    """Drafts are measured on prompts they never trained on (splitserve/data/README.md)."""
    from microbench.spec_decode import CHAT_QUESTION
    from microbench.tree_drafts import HELD_OUT_QUESTIONS

    texts, _ = prompt_texts(None, 10_000)
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert parser.get_default("num_prompts") == len(texts)  # by default, every shipped prompt
    shipped = {" ".join(text.lower().split()) for text in texts}
    for question in (CHAT_QUESTION, *HELD_OUT_QUESTIONS):
        assert " ".join(question.lower().split()) not in shipped, question


@pytest.mark.parametrize(("method", "steps"), [("medusa", 500), ("eagle", 1500), ("eagle3", 1500)])
def test_each_method_trains_for_its_own_number_of_steps_unless_told(method: str, steps: int) -> None:
    """An EAGLE(-3) draft needs about 12 passes over the shipped prompts (docs/benchmarks.md);
    Medusa heads, a step being 256 positions, fewer steps."""
    from splitserve.train_heads import medusa_settings, self_distillation_fields

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    for argv, expected in (([], steps), (["--steps", "7"], 7)):
        args = parser.parse_args(["--method", method, "--output", "heads", *argv])
        if method == "medusa":
            assert medusa_settings(args).num_steps == expected
        else:
            assert self_distillation_fields(args)["num_steps"] == expected
