"""What ``splitserve up`` passes on to every engine instance it starts."""

from __future__ import annotations

import argparse
from pathlib import Path

from launcher.up import add_arguments, engine_flags
from serving.instance import add_instance_arguments


def _instance_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_instance_arguments(parser, default_port=0)
    return parser.parse_args(list(argv))


def _up_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(list(argv))


def test_step_token_budget_reaches_every_instance_as_it_parses_it() -> None:
    flags = engine_flags(_up_args("--max-num-batched-tokens", "256", "--max-model-len", "512"), Path("/m"))
    instance = _instance_args(*flags)
    assert (instance.max_num_batched_tokens, instance.max_model_len, instance.model) == (256, 512, "/m")


def test_unset_options_leave_the_instances_defaults() -> None:
    flags = engine_flags(_up_args(), Path("/m"))
    assert flags == ["--model", "/m", "--dtype", _up_args().dtype]
    assert _instance_args(*flags).max_num_batched_tokens == _instance_args().max_num_batched_tokens
