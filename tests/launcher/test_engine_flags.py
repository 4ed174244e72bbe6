"""What ``splitserve up`` passes on to every engine instance it starts."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from cluster.auth import ClusterSecret
from cluster.derived_keys import prefix_cache_key
from engine.spec_decode.config import SpeculativeConfig
from engine_args.flags import add_engine_arguments, speculative_argv
from launcher.up import add_arguments, engine_flags, instance_cpus
from serving.instance import add_instance_arguments, engine_config


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


def _engine_flag_names() -> list[str]:
    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    return sorted(vars(parser.parse_args([])))


def test_unset_options_leave_the_instances_defaults() -> None:
    passed_on = _instance_args(*engine_flags(_up_args(), Path("/m")))
    defaults = _instance_args("--model", "/m")
    assert {name: getattr(passed_on, name) for name in _engine_flag_names()} == {
        name: getattr(defaults, name) for name in _engine_flag_names()
    }
    assert defaults.dtype == "auto"


def test_every_engine_flag_reaches_every_instance_as_given() -> None:
    given = [
        "--dtype",
        "bfloat16",
        "--kv-cache-memory",
        "4194304",
        "--max-model-len",
        "512",
        "--max-num-batched-tokens",
        "256",
        "--long-prefill-token-threshold",
        "384",
        "--prefix-cache-hash",
        "sha256",
        "--kv-cache-dtype",
        "fp8_e4m3",
        "--quant-activations",
        "q8",
    ]
    up = _up_args(*given)
    instance = _instance_args(*engine_flags(up, Path("/m")))
    for name in _engine_flag_names():
        if name != "model":
            assert getattr(instance, name) == getattr(up, name), name
    assert instance.model == "/m"
    assert (instance.dtype, instance.max_num_batched_tokens, instance.long_prefill_token_threshold) == (
        "bfloat16",
        256,
        384,
    )
    config = engine_config(instance, "decode")
    assert (config.kv_cache_dtype, config.quant_activations) == ("fp8_e4m3", "q8")


@pytest.mark.parametrize("role", ["decode", "colocated"])
def test_speculative_flags_reach_decoding_instances_as_the_engine_reads_them(role: str) -> None:
    up = _up_args("--num-speculative-tokens", "3", "--speculative-ngram-max", "5")
    instance = _instance_args(*speculative_argv(up))
    assert engine_config(instance, role).speculative == SpeculativeConfig(num_speculative_tokens=3, ngram_max=5)
    assert speculative_argv(_up_args()) == []


def test_prompt_chunk_cap_reaches_every_instance_as_given() -> None:
    for given, expected in (("384", 384), ("auto", "auto"), ("0", 0)):
        flags = engine_flags(_up_args("--long-prefill-token-threshold", given), Path("/m"))
        assert _instance_args(*flags).long_prefill_token_threshold == expected


def test_prompt_chunk_cap_defaults_to_auto_on_prefill_instances_only() -> None:
    defaults = _instance_args()
    assert engine_config(defaults, "prefill").long_prefill_token_threshold == "auto"
    assert engine_config(defaults, "decode").long_prefill_token_threshold is None
    assert engine_config(defaults, "colocated").long_prefill_token_threshold is None
    # 0 turns the cap off, a count sets it, on any role.
    assert (
        engine_config(_instance_args("--long-prefill-token-threshold", "0"), "prefill").long_prefill_token_threshold
        is None
    )
    assert (
        engine_config(_instance_args("--long-prefill-token-threshold", "512"), "colocated").long_prefill_token_threshold
        == 512
    )


@pytest.mark.parametrize("value", ["1", "-5", "half"])
def test_a_bad_prompt_chunk_cap_is_refused_when_parsed(value: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        _instance_args("--long-prefill-token-threshold", value)
    assert "--long-prefill-token-threshold" in capsys.readouterr().err


def test_the_prefix_cache_hash_is_keyed_by_the_cluster_secret_where_there_is_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("SPLITSERVE_CLUSTER_SECRET", raising=False)
    monkeypatch.delenv("SPLITSERVE_CLUSTER_SECRET_FILE", raising=False)
    assert engine_config(_instance_args(), "decode").block_hasher.name == "xxh3"
    assert engine_config(_instance_args("--prefix-cache-hash", "sha256"), "decode").block_hasher.name == "sha256"
    secret = "a cluster secret of some length"
    monkeypatch.setenv("SPLITSERVE_CLUSTER_SECRET", secret)
    for role in ("prefill", "decode", "colocated"):
        for flags in ((), ("--prefix-cache-hash", "auto"), ("--prefix-cache-hash", "sha256")):
            config = engine_config(_instance_args(*flags), role)  # type: ignore[arg-type]
            assert config.block_hasher.name == "hmac-sha256", flags  # by default too, where there is a secret
            assert config.prefix_cache_hash_key == prefix_cache_key(ClusterSecret.from_text(secret))
    # Asked for outright, the fast unkeyed hash stays available.
    assert engine_config(_instance_args("--prefix-cache-hash", "xxh3"), "decode").block_hasher.name == "xxh3"


def test_each_prefill_instance_gets_its_own_cpu_list_or_the_shared_one() -> None:
    own = instance_cpus(_up_args("--num-prefill", "2", "--prefill-cpus", "0|0", "--decode-cpus", "0"))
    assert own == {"prefill": [{0}, {0}], "decode": [{0}], "colocated": [None]}
    assert instance_cpus(_up_args("--num-decode", "2"))["decode"] == [None, None]
    with pytest.raises(ValueError, match="3 lists for 2 instances"):
        instance_cpus(_up_args("--num-prefill", "2", "--prefill-cpus", "0|0|0"))
