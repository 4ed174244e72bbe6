"""``splitserve bench sweep``: one ``bench serve`` run per request rate against one
endpoint, one result JSON each, all under one label so ``bench plot`` draws them as
a series.

Each rate gets its own seed (``--seed`` + its index): the prompts of one rate are
never the prompts of another, so a server's prefix cache cannot serve a later rate
from an earlier one's work. The workload's shape is the same at every rate.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from bench.serve import ServeConfig, benchmark, resolve_target, result_path, save_result


def parse_rates(text: str) -> list[float]:
    """``"1,2,4,inf"`` -> ``[1.0, 2.0, 4.0, inf]``."""
    try:
        rates = [float(item) for item in text.split(",") if item.strip()]
    except ValueError:
        raise ValueError(f"--request-rates takes numbers separated by commas, e.g. 1,2,4,inf; got {text!r}") from None
    if not rates or not all(rate > 0 for rate in rates):
        raise ValueError(f"--request-rates must list rates > 0 (or inf), got {text!r}")
    if len(set(rates)) != len(rates):
        raise ValueError(f"--request-rates lists a rate twice: {text!r}")
    return rates


def sweep_label(config: ServeConfig) -> str:
    return config.label or urlparse(config.base_url).netloc or config.base_url


def run_sweep(config: ServeConfig, rates: list[float], result_dir: str | Path) -> Iterator[tuple[dict[str, Any], Path]]:
    """Run each rate in the order given; yields each result and where it was saved."""
    target = resolve_target(config)
    label = sweep_label(config)
    for index, rate in enumerate(rates):
        run_config = replace(config, request_rate=rate, seed=config.seed + index, label=label)
        result = benchmark(run_config, target)
        yield result, save_result(result, result_path(result, result_dir, None))
