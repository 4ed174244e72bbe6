"""The server's token gaps beside the client's (bench/token_gaps.py): the gateway's chunk times
paired with the chunks the client read, the client-lag rule, and where runs report both; on
synthetic bytes and timings."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from bench.client import RequestRecord, StreamAccumulator
from bench.metrics import RunInfo, compute_metrics, result_json
from bench.overload import summarize
from bench.report import format_result
from bench.sse import SSEDecoder
from bench.token_gaps import CLIENT_LAG_MS, compare_gaps, parse_chunk_times, server_gaps
from tests.bench.factories import make_record


def _chat(**delta: str) -> str:
    return "data: " + json.dumps({"choices": [{"index": 0, "delta": delta, "finish_reason": None}]}) + "\n\n"


USAGE = "data: " + json.dumps({"choices": [], "usage": {"prompt_tokens": 4, "completion_tokens": 3}}) + "\n\n"
# Written by the server at 0, 0.1, 20.1, 45.6, 45.7 and 45.8 ms: the role chunk, three tokens,
# the finish chunk and the usage chunk.
CHAT_EVENTS = [
    _chat(role="assistant", content=""),
    _chat(content=" a"),
    _chat(content=" b"),
    _chat(content=" c"),
    _chat(content=""),
    USAGE,
]
TIMES = ": splitserve-chunk-times-ms=0.000,0.100,20.100,45.600,45.700,45.800\n\n"


def _read(pieces: list[tuple[float, str]]) -> RequestRecord:
    """A stream read as the client does: each piece is one network read at its time."""
    stream = StreamAccumulator(RequestRecord(prompt_len=4, output_len=3), sent_at=10.0)
    decoder = SSEDecoder(on_comment=stream.on_comment)
    for now, piece in pieces:
        for event in decoder.feed(piece.encode()):
            stream.on_event(event, now)
    return stream.finish()


def test_the_servers_gaps_pair_with_the_content_chunks_the_client_read() -> None:
    record = _read(
        [
            (10.2, ": keep-alive\n\n" + CHAT_EVENTS[0] + CHAT_EVENTS[1]),
            (10.3, CHAT_EVENTS[2]),
            # A starved client reads the rest at once: its last gap is 0, the server's 25.5 ms.
            (10.4, "".join(CHAT_EVENTS[3:]) + TIMES + "data: [DONE]\n\n"),
        ]
    )
    assert record.success
    assert record.itl == pytest.approx([0.1, 0.1])
    assert record.server_itl == pytest.approx([0.020, 0.0255])  # " a" -> " b", " b" -> " c": the role chunk is no token


@pytest.mark.parametrize(
    "times",
    [
        "",  # a server that sends none (another server, or not asked)
        ": splitserve-chunk-times-ms=0.000,0.100,20.100,45.600,45.700\n\n",  # one event fewer than read
        ": splitserve-chunk-times-ms=0.000,0.100,20.100,45.600,45.700,45.800,46.000\n\n",  # one more
        ": splitserve-chunk-times-ms=0.000,0.1x\n\n",
    ],
)
def test_without_times_that_count_every_event_read_there_are_no_server_gaps(times: str) -> None:
    record = _read([(10.2, "".join(CHAT_EVENTS) + times + "data: [DONE]\n\n")])
    assert record.success and record.server_itl is None


def test_parse_chunk_times_and_server_gaps() -> None:
    assert parse_chunk_times("splitserve-chunk-times-ms=0.000,1.500,3.250") == [0.0, 1.5, 3.25]
    assert parse_chunk_times("splitserve-chunk-times-ms=") == []
    assert parse_chunk_times("keep-alive") is None
    assert parse_chunk_times("other=1,2") is None
    assert parse_chunk_times("splitserve-chunk-times-ms=1,two") is None
    # Completions: every event a token but the usage chunk; gaps between consecutive content chunks.
    assert server_gaps([0.0, 10.0, 30.0, 31.0], [0, 1, 2]) == pytest.approx([0.010, 0.020])
    assert server_gaps([0.0, 10.0], [1]) == []


def test_a_client_lags_where_its_gaps_exceed_the_servers_by_more_than_the_threshold() -> None:
    steady = [0.010] * 999
    # One stall of the client alone (the server wrote on time): only the maximum is the client's.
    one_stall = compare_gaps([([*steady, 0.500], [*steady, 0.010])])
    assert one_stall is not None and one_stall.lagged_at == ("max",) and one_stall.client_lagged
    assert one_stall.client_ms["max"] == pytest.approx(500.0) and one_stall.server_ms["max"] == pytest.approx(10.0)
    assert (one_stall.num_requests, one_stall.num_gaps) == (1, 1000)
    # The run: every stream stopping at once for seconds on the client, the server on time.
    stalls = [0.010] * 980 + [2.5] * 20
    starved = compare_gaps([(stalls, [0.010] * 980 + [0.060] * 20)])
    assert starved is not None and starved.lagged_at == ("p99", "p99.9", "max")
    # Just under and just over the threshold.
    margin = CLIENT_LAG_MS / 1000
    under = compare_gaps([([0.010, 0.010 + margin - 0.001], [0.010, 0.010])])
    over = compare_gaps([([0.010, 0.010 + margin + 0.001], [0.010, 0.010])])
    assert under is not None and not under.client_lagged
    assert over is not None and over.lagged_at == ("p99", "p99.9", "max")  # of two gaps, p99 is near the max


def test_a_server_that_stalls_is_no_client_lag_and_reads_bundled_by_the_client_are_none_either() -> None:
    server_stalls = compare_gaps([([0.010, 0.900, 0.010], [0.010, 0.895, 0.012])])
    bundled = compare_gaps([([0.030, 0.0, 0.0], [0.010, 0.010, 0.010])])  # three chunks in one read
    assert server_stalls is not None and not server_stalls.client_lagged
    assert bundled is not None and not bundled.client_lagged
    assert compare_gaps([]) is None
    with pytest.raises(RuntimeError, match="bug"):
        compare_gaps([([0.01, 0.01], [0.01])])


def _info() -> RunInfo:
    return RunInfo(
        date="20250101-000000",
        backend="openai",
        label="t",
        model_id="m",
        tokenizer_id="tok",
        num_prompts=3,
        request_rate=math.inf,
        burstiness=1.0,
        max_concurrency=None,
        base_url="http://x",
        endpoint="/v1/completions",
        dataset="random",
        seed=0,
        num_warmups=0,
        goodput_slos_ms={},
    )


def test_a_run_reports_both_sides_only_over_requests_with_the_servers_times(tmp_path: Path) -> None:
    records = [
        make_record(itl=[0.010, 0.400], server_itl=[0.010, 0.012]),
        make_record(itl=[0.900]),  # no times: left out of the comparison
        make_record(itl=[0.010], server_itl=[0.011], error="broken"),
    ]
    result = result_json(_info(), records, compute_metrics(records, 2.0), 2.0)
    gaps = result["token_gaps"]
    assert (gaps["num_requests"], gaps["num_gaps"]) == (1, 2)
    assert gaps["client_ms"]["max"] == pytest.approx(400.0) and gaps["server_ms"]["max"] == pytest.approx(12.0)
    assert gaps["client_lagged"] and gaps["lagged_at"] == ["p50", "p99", "p99.9", "max"]
    assert result["server_itls"] == [[0.010, 0.012], None, None]
    report = format_result(result)
    assert "Token Gaps: Client vs Server" in report
    assert "CLIENT LAGGED at p50, p99, p99.9, max" in report and "server gap + 20 ms" in report

    (tmp_path / "run.json").write_text(json.dumps(result))
    row = summarize(tmp_path / "run.json")
    assert row["itl_max_ms"] == pytest.approx(900.0)  # the client's, every request
    assert row["server_itl_max_ms"] == pytest.approx(12.0) and row["server_num_gaps"] == 2
    assert row["client_lagged"] and row["client_lagged_at"] == ["p50", "p99", "p99.9", "max"]

    kept_up = [make_record(itl=[0.010, 0.030], server_itl=[0.011, 0.029])]
    result = result_json(_info(), kept_up, compute_metrics(kept_up, 1.0), 1.0)
    assert result["token_gaps"]["client_lagged"] is False
    assert "client kept up" in format_result(result)
    without = [make_record(itl=[0.010])]
    result = result_json(_info(), without, compute_metrics(without, 1.0), 1.0)
    assert result["token_gaps"] is None and "Token Gaps" not in format_result(result)
    (tmp_path / "other.json").write_text(json.dumps(result))
    assert "client_lagged" not in summarize(tmp_path / "other.json")
