"""``--speculative-config`` as vLLM spells it: the same config on every command that takes the
speculative flags, passed on by ``splitserve up`` to its decoding instances, and a clear error
for each way to get it wrong."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from engine.spec_decode.config import SpeculativeConfig
from engine_args.config import speculative_config_from_args
from engine_args.flags import speculative_argv
from launcher import up
from serving.instance import add_instance_arguments
from splitserve import generate
from tests.engine.spec_decode.medusa_heads import make_medusa_heads


def _instance(parser: argparse.ArgumentParser) -> None:
    add_instance_arguments(parser, default_port=0)


COMMANDS = {"instance": (_instance, []), "up": (up.add_arguments, []), "generate": (generate.add_arguments, ["hi"])}


def _config(command: str, *argv: str) -> SpeculativeConfig | None:
    add, required = COMMANDS[command]
    parser = argparse.ArgumentParser()
    add(parser)
    return speculative_config_from_args(parser.parse_args([*required, *argv]))


def _given(**fields: object) -> str:
    return json.dumps(fields)


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_every_command_reads_the_json_as_the_engines_config(command: str, tmp_path: Path) -> None:
    ngram = _given(method="ngram", num_speculative_tokens=3, prompt_lookup_min=1, prompt_lookup_max=5)
    assert _config(command, "--speculative-config", ngram) == SpeculativeConfig(
        method="ngram", num_speculative_tokens=3, ngram_min=1, ngram_max=5
    )
    draft = _given(method="draft_model", model="/draft", num_speculative_tokens=2)
    assert _config(command, "--speculative-config", draft) == SpeculativeConfig(
        method="draft_model", model="/draft", num_speculative_tokens=2
    )
    heads = str(make_medusa_heads(tmp_path / "heads", "vllm", num_heads=3))
    assert _config(command, "--speculative-config", _given(method="medusa", model=heads, num_speculative_tokens=2)) == (
        SpeculativeConfig(method="medusa", model=heads, num_speculative_tokens=2)
    )
    assert _config(command, "--speculative-config", _given(method="eagle", model="/e", num_speculative_tokens=5)) == (
        SpeculativeConfig(method="eagle", model="/e", num_speculative_tokens=5)
    )
    assert _config(command, "--speculative-config", _given(method="eagle3", model="/e", num_speculative_tokens=3)) == (
        SpeculativeConfig(method="eagle3", model="/e", num_speculative_tokens=3)
    )
    # Without a count, Medusa drafts one token per head, as vLLM does.
    assert _config(command, "--speculative-config", _given(method="medusa", model=heads)) == SpeculativeConfig(
        method="medusa", model=heads, num_speculative_tokens=3
    )


@pytest.mark.parametrize(
    ("given", "message"),
    [
        (_given(method="eagle"), "EAGLE speculation needs the draft's folder"),
        (_given(method="eagle3"), "EAGLE-3 speculation needs the draft's folder"),
        (_given(method="lookahead"), "must be one of ngram, draft_model, medusa"),
        (_given(model="/m"), 'needs a "method"'),
        (_given(method="ngram", draft_tensor_parallel_size=1), r"unknown keys \['draft_tensor_parallel_size'\]"),
        (_given(method="ngram", num_speculative_tokens="4"), "num_speculative_tokens must be a int"),
        (_given(method="medusa"), "Medusa speculation needs the heads' folder"),
        ("{method: ngram}", "must be a JSON object"),
        ('["ngram"]', "must be a JSON object"),
    ],
)
def test_a_wrong_config_says_what_is_wrong(given: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        _config("generate", "--speculative-config", given)


def test_the_json_and_the_older_flags_do_not_mix() -> None:
    with pytest.raises(ValueError, match="drop --num-speculative-tokens, --speculative-ngram-max"):
        _config(
            "generate",
            "--speculative-config",
            _given(method="ngram"),
            "--num-speculative-tokens",
            "2",
            "--speculative-ngram-max",
            "3",
        )
    # The older flags alone keep working.
    assert _config("generate", "--num-speculative-tokens", "2") == SpeculativeConfig(num_speculative_tokens=2)


def test_up_passes_the_json_on_to_decoding_instances(tmp_path: Path) -> None:
    heads = str(make_medusa_heads(tmp_path / "heads", "medusa-1", num_heads=2))
    given = _given(method="medusa", model=heads)
    parser = argparse.ArgumentParser()
    up.add_arguments(parser)
    argv = speculative_argv(parser.parse_args(["--speculative-config", given]))
    assert argv == ["--speculative-config", given]
    assert _config("instance", *argv) == SpeculativeConfig(method="medusa", model=heads, num_speculative_tokens=2)
