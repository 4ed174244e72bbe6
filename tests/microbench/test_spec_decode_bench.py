"""microbench.spec_decode's side-by-side runner and summary, on a tiny checkpoint."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.config import EngineConfig
from engine.engine_core import EngineCore
from engine.spec_decode.config import SpeculativeConfig
from microbench.spec_decode import RunResult, run_side_by_side, summarize
from tests.checkpoints import make_checkpoint


def plain_and_ngram_engines(tmp_path: Path) -> dict[str, EngineCore]:
    common = dict(model=str(make_checkpoint(tmp_path)), dtype="float32", kv_cache_memory=1 << 22)
    return {
        "plain": EngineCore(EngineConfig(**common)),  # type: ignore[arg-type]
        "spec": EngineCore(EngineConfig(**common, speculative=SpeculativeConfig(ngram_min=1))),  # type: ignore[arg-type]
    }


def test_side_by_side_times_each_engine_on_its_own_steps(tmp_path: Path) -> None:
    engines = plain_and_ngram_engines(tmp_path)
    timings = run_side_by_side(engines, [[9, 8, 7, 6] * 6 + [9, 8]], output_len=24, temperature=0.0, seed=0)
    assert {name: t.num_tokens for name, t in timings.items()} == {"plain": 24, "spec": 24}
    assert all(t.ttft_s > 0 and t.decode_s > 0 for t in timings.values())
    assert engines["spec"].scheduler.spec_stats.num_accepted_tokens > 0


def test_side_by_side_runs_concurrent_streams_and_times_decode_once_each_has_its_first_token(tmp_path: Path) -> None:
    engines = plain_and_ngram_engines(tmp_path)
    steps = {name: 0 for name in engines}
    for name, core in engines.items():
        step = core.step

        def counting(name: str = name, step=step):  # type: ignore[no-untyped-def]
            steps[name] += 1
            return step()

        core.step = counting  # type: ignore[method-assign]
    prompts = [[9, 8, 7, 6] * 6 + [9, 8], [5, 4, 3] * 5, [11, 12] * 9]
    timings = run_side_by_side(engines, prompts, output_len=12, temperature=0.0, seed=0)
    assert {name: t.num_tokens for name, t in timings.items()} == {"plain": 36, "spec": 36}
    assert all(t.ttft_s > 0 and t.decode_s > 0 and len(t.first_tokens) == 3 for t in timings.values())
    # The plain engine: one step gives the three first tokens, then 11 decode steps of three rows.
    assert steps["plain"] == 12
    assert engines["spec"].scheduler.spec_stats.num_draft_tokens > 0


def test_summary_is_the_median_per_side_and_the_acceptance_over_all_rounds() -> None:
    runs = [
        RunResult("code", "plain", 0, 30.0, 30.0, 1.0, 8, 0, 0),
        RunResult("code", "spec", 0, 10.0, 12.0, 1.0, 8, 8, 6),
        RunResult("code", "plain", 1, 40.0, 30.0, 1.0, 8, 0, 0),
        RunResult("code", "spec", 1, 20.0, 12.0, 1.0, 8, 8, 2),
        RunResult("code", "plain", 2, 35.0, 30.0, 1.0, 8, 0, 0),
        RunResult("code", "spec", 2, 14.0, 12.0, 1.0, 8, 4, 0),
    ]
    (row,) = summarize(runs)
    assert (row["plain_ms_per_token"], row["spec_ms_per_token"], row["speedup"]) == (35.0, 14.0, 2.5)
    assert (row["num_draft_tokens"], row["num_accepted_tokens"], row["acceptance_rate"]) == (20, 8, 0.4)


def test_medusa_heads_through_the_speculative_config(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from microbench.spec_decode import main
    from tests.engine.spec_decode.medusa_heads import make_medusa_heads

    model = make_checkpoint(tmp_path / "model")
    heads = make_medusa_heads(tmp_path / "heads", "vllm", num_heads=2)
    config = f'{{"method": "medusa", "model": "{heads}"}}'
    argv = ["--model", str(model), "--speculative-config", config, "--workloads", "random", "--output-len", "6"]
    assert main([*argv, "--rounds", "1", "--random-input-len", "12", "--kv-cache-memory", str(1 << 22)]) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last.startswith("acceptance at each draft depth: ") and "mean accepted length" in last
