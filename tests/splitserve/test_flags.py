"""The flags the commands share (engine_args/flags.py): one declaration, the same choices and
defaults on every command that takes it, choices that are the engine's, and help that states
the engine's real defaults."""

from __future__ import annotations

import argparse
import ast
from collections.abc import Callable
from pathlib import Path
from typing import get_args

import pytest

from engine.config import DEFAULT_KV_CACHE_MEMORY, QUANT_ACTIVATIONS, DTypeName, QuantActivations, QuantizationName
from engine.default_model import LOAD_FORMATS, LoadFormat
from engine.kv_cache_dtype import KV_CACHE_DTYPES as ENGINE_KV_CACHE_DTYPES
from engine.kv_cache_dtype import KVCacheDType
from engine.kv_cache_utils import PREFIX_CACHE_HASHES as ENGINE_PREFIX_CACHE_HASHES
from engine.kv_cache_utils import PrefixCacheHash
from engine.spec_decode.config import SpecMethod, SpeculativeConfig
from engine_args.config import speculative_config_from_args
from engine_args.flags import DTYPES, KV_CACHE_DTYPES, PREFIX_CACHE_HASHES, add_engine_arguments
from kv_connector.registry import BACKENDS
from launcher import up
from serving.instance import add_instance_arguments
from splitserve import generate


def _instance(parser: argparse.ArgumentParser) -> None:
    add_instance_arguments(parser, default_port=0)


# command -> (its add_arguments, argv its required arguments need)
COMMANDS: dict[str, tuple[Callable[[argparse.ArgumentParser], None], list[str]]] = {
    "instance": (_instance, []),
    "up": (up.add_arguments, []),
    "generate": (generate.add_arguments, ["a prompt"]),
}


def _parse(command: str, *argv: str) -> argparse.Namespace:
    add, required = COMMANDS[command]
    parser = argparse.ArgumentParser()
    add(parser)
    return parser.parse_args([*required, *argv])


def _help(name: str) -> str:
    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    (action,) = [action for action in parser._actions if name in action.option_strings]
    return action.help or ""


def _choices(name: str) -> tuple[object, ...]:
    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    (action,) = [action for action in parser._actions if name in action.option_strings]
    assert action.choices is not None
    return tuple(action.choices)


# flag -> the engine's choices, in its own order where it keeps a tuple (else its Literal's).
ENGINE_CHOICES: dict[str, tuple[object, ...]] = {
    "--dtype": get_args(DTypeName),
    "--load-format": LOAD_FORMATS,
    "--quantization": get_args(QuantizationName),
    "--quant-activations": QUANT_ACTIVATIONS,
    "--kv-cache-dtype": ENGINE_KV_CACHE_DTYPES,
    "--prefix-cache-hash": ("auto", *ENGINE_PREFIX_CACHE_HASHES),
}


def test_every_choice_list_is_the_engines() -> None:
    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    with_choices = {action.option_strings[0] for action in parser._actions if action.choices is not None}
    assert with_choices == set(ENGINE_CHOICES), "a flag with choices: tie them to the engine's here"
    for flag, engine_choices in ENGINE_CHOICES.items():
        assert sorted(map(str, _choices(flag))) == sorted(map(str, engine_choices)), flag
    # The engine's tuples are its Literals' values.
    assert get_args(LoadFormat) == LOAD_FORMATS
    assert get_args(QuantActivations) == QUANT_ACTIVATIONS
    assert get_args(KVCacheDType) == ENGINE_KV_CACHE_DTYPES


def test_the_speculative_flags_choose_the_engines_methods() -> None:
    on = [
        _parse("generate", "--num-speculative-tokens", "2"),
        _parse("generate", "--speculative-model", "/d"),
        _parse("generate", "--speculative-config", '{"method": "medusa", "model": "/m", "num_speculative_tokens": 2}'),
        _parse("generate", "--speculative-config", '{"method": "eagle", "model": "/e", "num_speculative_tokens": 2}'),
        _parse("generate", "--speculative-config", '{"method": "eagle3", "model": "/e", "num_speculative_tokens": 2}'),
    ]
    methods = {config.method for config in map(speculative_config_from_args, on) if config is not None}
    assert methods == set(get_args(SpecMethod))


def test_dtype_choices_are_the_engines() -> None:
    assert sorted(DTYPES) == sorted(get_args(DTypeName))


def test_prefix_cache_hash_choices_are_the_engines() -> None:
    assert PREFIX_CACHE_HASHES == ENGINE_PREFIX_CACHE_HASHES == get_args(PrefixCacheHash)
    for command in COMMANDS:
        assert _parse(command).prefix_cache_hash == "auto"
        assert _parse(command, "--prefix-cache-hash", "xxh3").prefix_cache_hash == "xxh3"
        assert _parse(command, "--prefix-cache-hash", "sha256").prefix_cache_hash == "sha256"


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_every_command_defaults_to_auto_and_takes_every_dtype(command: str) -> None:
    assert _parse(command).dtype == "auto"
    for dtype in DTYPES:
        assert _parse(command, "--dtype", dtype).dtype == dtype
    with pytest.raises(SystemExit):
        _parse(command, "--dtype", "float64")


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_every_command_takes_the_engines_kv_cache_dtypes_and_defaults_to_auto(command: str) -> None:
    assert KV_CACHE_DTYPES == ENGINE_KV_CACHE_DTYPES == get_args(KVCacheDType)
    assert _parse(command).kv_cache_dtype == "auto"
    for kv_cache_dtype in KV_CACHE_DTYPES:
        assert _parse(command, "--kv-cache-dtype", kv_cache_dtype).kv_cache_dtype == kv_cache_dtype
    with pytest.raises(SystemExit):
        _parse(command, "--kv-cache-dtype", "fp8")


@pytest.mark.parametrize("command", ["instance", "up"])
def test_connector_choices_are_the_registrys(command: str) -> None:
    for name in BACKENDS:
        assert _parse(command, "--kv-connector", name).kv_connector == name
    with pytest.raises(SystemExit):
        _parse(command, "--kv-connector", "nixl")


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_every_command_parses_the_engine_flags_alike(command: str) -> None:
    argv = ["--max-num-batched-tokens", "512", "--long-prefill-token-threshold", "auto", "--kv-cache-memory", "8"]
    args = _parse(command, *argv)
    assert (args.max_num_batched_tokens, args.long_prefill_token_threshold, args.kv_cache_memory) == (512, "auto", 8)


def test_help_states_the_engines_defaults() -> None:
    assert DEFAULT_KV_CACHE_MEMORY == 1 << 30 and "(default: 1 GiB)" in _help("--kv-cache-memory")
    defaults = SpeculativeConfig()
    assert f"(default: {defaults.ngram_min})" in _help("--speculative-ngram-min")
    assert f"(default: {defaults.ngram_max})" in _help("--speculative-ngram-max")


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_speculation_is_off_unless_asked_and_unset_bounds_keep_the_configs_defaults(command: str) -> None:
    assert speculative_config_from_args(_parse(command)) is None
    assert speculative_config_from_args(_parse(command, "--num-speculative-tokens", "2")) == SpeculativeConfig(
        num_speculative_tokens=2
    )
    assert speculative_config_from_args(_parse(command, "--speculative-model", "/draft")) == SpeculativeConfig(
        method="draft_model", model="/draft"
    )


ROOT = Path(__file__).resolve().parents[2]
# The engine flags with one meaning and one set of choices everywhere: declared in engine_args/flags.py alone.
SHARED_FLAGS = {
    "--dtype",
    "--kv-cache-dtype",
    "--load-format",
    "--quantization",
    "--quant-activations",
    "--prefix-cache-hash",
    "--tensor-parallel-size",
}


def declarations(source: str, flags: set[str]) -> list[str]:
    """Each ``add_argument`` call of ``source`` that declares one of ``flags``, as "line N: FLAG"."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "add_argument":
            names = [arg.value for arg in node.args if isinstance(arg, ast.Constant) and isinstance(arg.value, str)]
            found += [f"line {node.lineno}: {name}" for name in names if name in flags]
    return found


def test_the_check_sees_a_declaration() -> None:
    source = 'def f(p):\n    p.add_argument("--dtype", default="float32")\n    p.add_argument("--seed")\n'
    assert declarations(source, SHARED_FLAGS) == ["line 2: --dtype"]


def test_no_command_declares_an_engine_flag_of_its_own() -> None:
    """The benchmarks, microbenchmarks, simulator, instances and launcher take these flags from
    engine_args/flags.py (a benchmark may pass another default), so each means one thing."""
    assert {action.option_strings[0] for action in _engine_actions()} >= SHARED_FLAGS
    found = {}
    for path in sorted(ROOT.rglob("*.py")):
        relative = path.relative_to(ROOT)
        if relative.parts[0] in ("engine_args", "tests", ".venv", "build") or "egg-info" in str(relative):
            continue
        hits = declarations(path.read_text(), SHARED_FLAGS)
        if hits:
            found[str(relative)] = hits
    assert found == {}


def _engine_actions() -> list[argparse.Action]:
    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    return [action for action in parser._actions if action.option_strings]
