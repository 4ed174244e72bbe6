"""``bench.spec_methods``: its flags, the ShareGPT file bench serve reads back, the figures it
takes from bench serve's result JSON (built by bench/metrics.py and bench/spec_decode_metrics.py
themselves, so a renamed key fails here), the markdown table, and one small run end to end on
a tiny random checkpoint."""

from __future__ import annotations

import json
import random
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from transformers import PreTrainedTokenizerFast

from bench.datasets import sample_sharegpt
from bench.metrics import RunInfo, compute_metrics, result_json
from bench.spec_decode_metrics import SpecDecodeCounts, over_run
from bench.spec_methods import (
    DEFAULT_QUESTIONS,
    NO_SPECULATION,
    Method,
    RunFigures,
    acceptance_table,
    main,
    markdown_table,
    parse_args,
    parse_concurrencies,
    parse_deployments,
    parse_method,
    pd_cpu_flags,
    run_figures,
    sweep_order,
    write_sharegpt,
)
from tests.bench.factories import make_record
from tests.checkpoints import build_tokenizer, make_checkpoint

NGRAM = '{"method": "ngram", "num_speculative_tokens": 3}'


def test_a_method_is_none_or_a_label_with_its_speculative_config() -> None:
    assert parse_method("none") == Method("none", None)
    ngram = parse_method(f"ngram:{NGRAM}")
    assert ngram.label == "ngram" and json.loads(ngram.speculative_config or "") == json.loads(NGRAM)
    assert ngram.up_flags == ["--speculative-config", ngram.speculative_config]
    assert Method("none", None).up_flags == []
    with pytest.raises(ValueError, match="needs its speculative config"):
        parse_method("ngram")
    with pytest.raises(ValueError, match="not JSON"):
        parse_method("ngram:{method: ngram}")
    with pytest.raises(ValueError, match="a JSON object"):
        parse_method('ngram:["ngram"]')
    with pytest.raises(ValueError, match="takes no config"):
        parse_method(f"none:{NGRAM}")
    for unfit in (f":{NGRAM}", f"../ngram:{NGRAM}"):
        with pytest.raises(ValueError, match="needs a label of letters"):
            parse_method(unfit)


def test_no_speculation_runs_first_and_labels_must_differ() -> None:
    medusa, ngram, none = Method("medusa", "{}"), Method("ngram", "{}"), Method(NO_SPECULATION, None)
    assert sweep_order([medusa, none, ngram]) == [none, medusa, ngram]
    assert sweep_order([ngram, medusa]) == [ngram, medusa]
    with pytest.raises(ValueError, match="repeated: ngram"):
        sweep_order([ngram, none, Method("ngram", '{"x": 1}')])


def test_deployments_and_concurrencies_are_checked() -> None:
    assert parse_deployments("pd, colocated,pd") == ["pd", "colocated"]
    assert parse_concurrencies("1,8,1") == [1, 8]
    for bad in ("", "colocated,disaggregated"):
        with pytest.raises(ValueError, match="colocated,pd"):
            parse_deployments(bad)
    for bad in ("", "0,8", "one"):
        with pytest.raises(ValueError, match="like 1,8"):
            parse_concurrencies(bad)


def test_bad_flags_are_usage_errors_that_say_why(capsys: pytest.CaptureFixture, tmp_path: Path) -> None:
    with pytest.raises(SystemExit) as exit_info:
        parse_args(["--output-dir", str(tmp_path), "--method", "ngram"])
    assert exit_info.value.code == 2
    assert "--method ngram needs its speculative config" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse_args(["--output-dir", str(tmp_path), "--method", "none", "--method", "none"])
    assert "repeated: none" in capsys.readouterr().err
    args = parse_args(["--output-dir", str(tmp_path), "--method", f"ngram:{NGRAM}", "--method", "none"])
    assert [m.label for m in args.methods] == ["none", "ngram"]
    assert (args.deployments, args.concurrency, args.output_len, args.dtype) == (
        ["colocated", "pd"],
        [1, 8],
        128,
        "float32",
    )
    assert args.questions == list(DEFAULT_QUESTIONS) and args.rounds == len(DEFAULT_QUESTIONS)


def test_the_sharegpt_file_gives_bench_serve_each_question_equally(
    tokenizer: PreTrainedTokenizerFast, tmp_path: Path
) -> None:
    # The test tokenizer knows made-up words only: questions of those, at least SHAREGPT_MIN_LEN tokens.
    questions = ["kalo bemi tuza foke nida", "rupe sola vimi teka gobu", "dena fiso lumo kiba pate"]
    path = write_sharegpt(tmp_path / "q.json", questions, 6)
    requests = sample_sharegpt(tokenizer, path, 6, random.Random(0), output_len=16)
    assert Counter(r.prompt for r in requests) == {question: 2 for question in questions}
    assert all(r.output_len == 16 for r in requests)
    with pytest.raises(ValueError, match="only 6 usable conversations"):
        sample_sharegpt(tokenizer, path, 7, random.Random(0), output_len=16)
    with pytest.raises(ValueError, match="--question"):
        write_sharegpt(tmp_path / "none.json", [], 4)


def bench_result(itl_s: float, num_output_tokens: int) -> dict[str, Any]:
    """A bench serve result JSON (bench/serve.py's ``benchmark``): two requests whose every
    token after the first came ``itl_s`` apart."""
    records = [
        make_record(ttft=0.05, itl=[itl_s] * (num_output_tokens - 1), output_tokens=num_output_tokens) for _ in range(2)
    ]
    info = RunInfo(
        date="20261207-000000",
        backend="openai-chat",
        label=None,
        model_id="m",
        tokenizer_id="m",
        num_prompts=2,
        request_rate=float("inf"),
        burstiness=1.0,
        max_concurrency=1,
        base_url="http://127.0.0.1:1",
        endpoint="/v1/chat/completions",
        dataset="sharegpt",
        seed=0,
        num_warmups=0,
        goodput_slos_ms={},
    )
    result = result_json(info, records, compute_metrics(records, duration_s=1.0), duration_s=1.0)
    result["spec_decode"] = None
    return json.loads(json.dumps(result))  # as read back from the file


def two_drafts_a_step() -> dict[str, Any] | None:
    """10 verification steps of two drafts each: 4 accepted none, 3 one, 3 both (9 accepted)."""
    after = SpecDecodeCounts(
        draft_tokens_per_pos=Counter({0: 10, 1: 10}),
        accepted_tokens_per_pos=Counter({0: 6, 1: 3}),
        verifications_by_accepted=Counter({0: 4, 1: 3, 2: 3}),
    )
    return over_run(SpecDecodeCounts(), after)


def test_figures_come_from_the_result_json_with_accepted_length_counting_the_verified_token() -> None:
    spec = two_drafts_a_step()
    figures = run_figures("pd", "eagle3", 8, bench_result(0.010, 5), spec)
    assert (figures.deployment, figures.method, figures.concurrency) == ("pd", "eagle3", 8)
    assert (figures.completed, figures.failed) == (2, 0)
    assert figures.mean_tpot_ms == pytest.approx(10.0) and figures.median_tpot_ms == pytest.approx(10.0)
    assert figures.mean_itl_ms == pytest.approx(10.0) and figures.median_ttft_ms == pytest.approx(50.0)
    assert figures.output_throughput == pytest.approx(10.0)  # 10 tokens in the run's 1 s
    assert figures.mean_accepted_length == pytest.approx(1.9)  # 9 drafts accepted over 10 steps, + 1 each
    assert figures.acceptance_rate_per_position == pytest.approx([0.6, 0.3])
    plain = run_figures("pd", "none", 8, bench_result(0.020, 5), None)
    assert plain.mean_accepted_length is None and plain.acceptance_rate_per_position is None


def figures(method: str, deployment: str, concurrency: int, tpot_ms: float | None, **more: Any) -> RunFigures:
    fields: dict[str, Any] = dict(
        completed=8,
        failed=0,
        mean_tpot_ms=tpot_ms,
        median_tpot_ms=tpot_ms,
        mean_itl_ms=tpot_ms,
        median_ttft_ms=50.0,
        output_throughput=100.0,
        mean_accepted_length=None,
        acceptance_rate_per_position=None,
    )
    return RunFigures(deployment, method, concurrency, **{**fields, **more})


def test_the_table_has_a_row_per_method_and_ratios_within_each_deployment_and_concurrency() -> None:
    runs = [
        figures("none", "colocated", 1, 20.0),
        figures("none", "colocated", 8, 40.0),
        figures("ngram", "colocated", 1, 15.0, mean_accepted_length=1.5, acceptance_rate_per_position=[0.4, None]),
        figures("ngram", "colocated", 8, 50.0, mean_accepted_length=1.25, failed=1),
        figures("none", "pd", 1, 10.0),
        figures("eagle3", "pd", 1, None, completed=0, failed=8),
    ]
    lines = markdown_table(runs).splitlines()
    assert lines[0] == (
        "| method: mean TPOT ms (x none), mean accepted length | colocated, 1 stream | colocated, 8 streams "
        "| pd, 1 stream |"
    )
    assert lines[1] == "|---|---|---|---|"
    assert lines[2] == "| none | 20.0 (1.00x), - | 40.0 (1.00x), - | 10.0 (1.00x), - |"
    assert lines[3] == "| ngram | 15.0 (0.75x), 1.50 | 50.0 (1.25x), 1.25, 1 failed | not run |"
    assert lines[4] == "| eagle3 | not run | not run | no TPOT (8 failed) |"
    assert len(lines) == 5
    assert acceptance_table(runs).splitlines()[2:] == ["| ngram | 40%, - | - | - |", "| eagle3 | - | - | - |"]
    without_baseline = markdown_table([figures("ngram", "pd", 1, 12.0, mean_accepted_length=2.0)])
    assert without_baseline.splitlines()[2] == "| ngram | 12.0, 2.00 |"


def test_pd_pins_prefill_to_the_first_half_of_the_cpus_and_decode_to_the_rest() -> None:
    assert pd_cpu_flags({0, 1}) == ["--prefill-cpus", "0", "--decode-cpus", "1"]
    assert pd_cpu_flags({5, 2, 3, 4}) == ["--prefill-cpus", "2,3", "--decode-cpus", "4,5"]
    assert pd_cpu_flags({0}) == []


CHAT_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] + ': ' + message['content'] + '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ 'assistant:' }}{% endif %}"
)


def make_chat_model(directory: Path) -> Path:
    """A tiny random checkpoint with a chat template, its vocabulary no larger than its
    tokenizer's: every token it generates has text, so answers stream token by token."""
    tokenizer = build_tokenizer()
    tokenizer.chat_template = CHAT_TEMPLATE
    make_checkpoint(directory, vocab_size=len(tokenizer))
    tokenizer.save_pretrained(directory)
    return directory


@pytest.mark.slow
def test_a_small_run_serves_each_method_and_tables_them(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """None and n-gram colocated on a tiny random chat checkpoint: two requests of 8 tokens each.
    n-gram lookups of one token find matches in the question's repeated words and the answer."""
    model = make_chat_model(tmp_path / "model")
    ngram = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}'
    output = tmp_path / "out"
    argv = [
        "--output-dir", str(output), "--model", str(model), "--method", f"ngram:{ngram}", "--method", "none",
        "--deployments", "colocated", "--concurrency", "1", "--rounds", "2", "--output-len", "8",
        "--question", "the quick brown fox " * 4, "--up-flags", f"--kv-cache-memory {64 << 20}",
    ]  # fmt: skip
    assert main(argv) == 0
    printed = capsys.readouterr().out
    runs = json.loads((output / "results.json").read_text())["runs"]
    assert [(r["method"], r["deployment"], r["concurrency"]) for r in runs] == [
        ("none", "colocated", 1),
        ("ngram", "colocated", 1),
    ]  # no speculation first, whatever the order given
    # TPOT only exists: the tiny model's tokens come faster than loopback keeps their chunks apart.
    assert all((r["completed"], r["failed"]) == (2, 0) and r["mean_tpot_ms"] >= 0 for r in runs)
    assert runs[0]["mean_accepted_length"] is None
    assert runs[1]["mean_accepted_length"] >= 1
    table = printed[printed.index("| method: mean TPOT") :].splitlines()
    assert table[2].startswith("| none | ") and table[2].endswith(", - |")
    assert table[3].startswith("| ngram | ") and table[3].endswith(f", {runs[1]['mean_accepted_length']:.2f} |")
    assert printed.startswith("CPU: ")
