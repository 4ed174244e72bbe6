"""The bench command line: arguments to a config, and user errors that name the fix."""

from __future__ import annotations

import argparse
import math

import pytest

from bench.cli import add_arguments, parse_percentiles, serve_config
from bench.datasets import TokenRange
from bench.sweep import parse_rates


def _parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(list(argv))


def test_serve_defaults_and_the_api_key_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OPENAI_API_KEY", "sk-env")
    config = serve_config(_parse("serve", "--base-url", "http://h:9/", "--goodput", "ttft:200", "e2el:900"))
    assert (config.base_url, config.endpoint, config.api_key) == ("http://h:9", "/v1/completions", "sk-env")
    assert math.isinf(config.request_rate) and config.burstiness == 1.0 and config.max_concurrency is None
    assert config.workload.dataset == "random"
    assert config.workload.classes[0].input_len == TokenRange(1024, 1024)
    assert config.workload.classes[0].output_len == TokenRange(128, 128)
    assert config.goodput_slos_ms == {"ttft": 200.0, "e2el": 900.0}
    assert config.percentiles == (90.0, 99.0) and config.ignore_eos is True


def test_mixed_and_shared_prefix_workloads_from_arguments() -> None:
    mixed = serve_config(_parse("serve", "--dataset", "mixed", "--mix", "1024-2048:32:0.5,128:256:0.5")).workload
    assert [c.name for c in mixed.classes] == ["1024-2048:32", "128:256"]
    shared = serve_config(
        _parse(
            "serve",
            "--dataset",
            "shared-prefix",
            "--num-prefixes",
            "4",
            "--prefix-len",
            "512",
            "--suffix-len",
            "64",
            "--output-len",
            "16",
        )
    ).workload
    assert (shared.num_prefixes, shared.prefix_len, shared.suffix_len, shared.output_len) == (4, 512, 64, 16)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--dataset", "mixed"], "needs --mix"),
        (["--mix", "10:10"], "goes with --dataset mixed"),
        (["--dataset", "sharegpt"], "needs --dataset-path"),
        (["--dataset-path", "x.json"], "goes with --dataset sharegpt"),
        (["--range-ratio", "1.5"], "--range-ratio"),
        (["--goodput", "ttft=5"], "NAME:MS"),
        (["--metric-percentiles", "100"], "(0, 100)"),
    ],
)
def test_user_errors_name_the_fix(argv: list[str], message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        serve_config(_parse("serve", *argv))


def test_rates_and_percentiles_lists() -> None:
    assert parse_rates("1, 2.5,inf") == [1.0, 2.5, math.inf]
    for bad in ("", "0,1", "fast", "2,2"):
        with pytest.raises(ValueError):
            parse_rates(bad)
    assert parse_percentiles("50,99.9") == (50.0, 99.9)
