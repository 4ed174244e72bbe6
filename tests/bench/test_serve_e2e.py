"""``splitserve bench serve|sweep`` end to end over real HTTP: against a FAKE
OpenAI-compatible server on loopback (tests/bench/fake_openai_server.py) whose
delays are known, and, once the gateway exists, against ``splitserve up``."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest

from bench.arrivals import arrival_offsets
from splitserve.cli import main
from tests.bench.fake_openai_server import FakeOpenAIServer, FakeServerConfig
from tests.gateway.processes import HTTPProcess
from tests.stores import free_port

TTFT_S, ITL_S = 0.05, 0.02
# Lower bounds are exact (the fake server sleeps at least this long); upper bounds
# leave room for a loaded 2-core machine.
SLACK_S = 0.25


def _serve(base_url: str, tokenizer_dir: Path, result_dir: Path, *extra: str) -> dict:
    args = [
        "bench",
        "serve",
        "--base-url",
        base_url,
        "--tokenizer",
        str(tokenizer_dir),
        "--disable-tqdm",
        "--save-result",
        "--result-dir",
        str(result_dir),
        "--result-filename",
        "result.json",
        *extra,
    ]
    main(args)
    return json.loads((result_dir / "result.json").read_text())


def test_bench_serve_against_a_fake_openai_server(
    tokenizer_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    monkeypatch.setenv("OPENAI_API_KEY", "sk-test")
    with FakeOpenAIServer(FakeServerConfig(ttft_s=TTFT_S, itl_s=ITL_S, api_key="sk-test")) as server:
        result = _serve(
            server.base_url,
            tokenizer_dir,
            tmp_path,
            "--num-prompts",
            "6",
            "--input-len",
            "40",
            "--output-len",
            "5",
            "--num-warmups",
            "2",
            "--goodput",
            "ttft:10000",
            "tpot:10000",
        )
    assert "Serving Benchmark Result" in capsys.readouterr().out
    assert (result["completed"], result["failed"], result["model_id"]) == (6, 0, "fake-model")  # model from /v1/models
    assert result["errors"] == [""] * 6
    # What the server got: warm-ups first, every body streaming with usage, exact lengths, the key.
    assert len(server.bodies) == 8
    for body, headers in zip(server.bodies, server.headers):
        assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
        assert body["ignore_eos"] is True and body["max_tokens"] == 5 and body["model"] == "fake-model"
        assert len(body["prompt"].split()) == 40  # one word per token with the test tokenizer
        assert headers["Authorization"] == "Bearer sk-test"
    assert result["input_lens"] == [40] * 6 and result["output_lens"] == [5] * 6
    assert result["total_input_tokens"] == 240 and result["total_output_tokens"] == 30
    for ttft, itls, latency in zip(result["ttfts"], result["itls"], result["latencies"]):
        assert TTFT_S <= ttft < TTFT_S + SLACK_S
        assert len(itls) == 4 and sum(itls) == pytest.approx(latency - ttft)
        assert latency >= TTFT_S + 4 * ITL_S
    assert ITL_S * 0.75 <= result["median_itl_ms"] / 1000 < ITL_S + SLACK_S
    assert result["median_tpot_ms"] == pytest.approx(
        statistics.median((lat - ttft) / 4 for lat, ttft in zip(result["latencies"], result["ttfts"])) * 1000
    )
    assert result["request_goodput"] == pytest.approx(result["request_throughput"])
    assert result["duration"] >= max(s + lat for s, lat in zip(result["start_times"], result["latencies"]))


def test_chat_endpoint_times_content_not_the_role_chunk(tokenizer_dir: Path, tmp_path: Path) -> None:
    with FakeOpenAIServer(FakeServerConfig(ttft_s=TTFT_S, itl_s=ITL_S)) as server:
        result = _serve(
            server.base_url,
            tokenizer_dir,
            tmp_path,
            "--endpoint",
            "/v1/chat/completions",
            "--num-prompts",
            "3",
            "--dataset",
            "shared-prefix",
            "--num-prefixes",
            "1",
            "--prefix-len",
            "30",
            "--suffix-len",
            "10",
            "--output-len",
            "3",
            "--model",
            "fake-model",
        )
    assert (result["completed"], result["backend"]) == (3, "openai-chat")
    assert all(ttft >= TTFT_S for ttft in result["ttfts"])  # the role delta comes at once
    assert result["generated_texts"] == [" w0 w1 w2"] * 3
    assert result["input_lens"] == [40] * 3
    for body in server.bodies:
        system, user = body["messages"]
        assert system["role"] == "system" and len(system["content"].split()) == 30
        assert user["role"] == "user" and len(user["content"].split()) == 10
    assert len({body["messages"][0]["content"] for body in server.bodies}) == 1


def _serve_one_at_a_time(server: FakeOpenAIServer, tokenizer_dir: Path, result_dir: Path, num_prompts: int) -> dict:
    """``num_prompts`` small requests (8 tokens in, 4 out), one at a time."""
    return _serve(
        server.base_url,
        tokenizer_dir,
        result_dir,
        *("--num-prompts", str(num_prompts), "--input-len", "8", "--output-len", "4", "--max-concurrency", "1"),
    )


def test_failed_requests_are_counted_with_their_errors(tokenizer_dir: Path, tmp_path: Path) -> None:
    config = FakeServerConfig(ttft_s=0.01, itl_s=0.005, http_error_at={1}, stream_error_at={3})
    with FakeOpenAIServer(config) as server:
        result = _serve_one_at_a_time(server, tokenizer_dir, tmp_path, num_prompts=6)
    assert (result["completed"], result["failed"]) == (4, 2)
    errors = [e for e in result["errors"] if e]
    assert len(errors) == 2
    assert any(e.startswith("HTTP 500") and "fake overload" in e for e in errors)
    assert any("fake engine failure" in e for e in errors)
    assert result["total_output_tokens"] == 16 and len(result["ttfts"]) == 6


def test_a_connection_closed_unanswered_is_sent_again_once(tokenizer_dir: Path, tmp_path: Path) -> None:
    """llama.cpp's llama-server closes a kept-alive connection every other request of a single
    stream; a request it closes before answering goes again on a new connection. One closed
    twice in a row fails."""
    config = FakeServerConfig(ttft_s=0.01, itl_s=0.005, disconnect_at={1, 3, 4})
    with FakeOpenAIServer(config) as server:
        result = _serve_one_at_a_time(server, tokenizer_dir, tmp_path, num_prompts=3)
        assert len(server.bodies) == 5  # the three requests, the last two twice
    assert (result["completed"], result["failed"]) == (2, 1)
    assert result["errors"][2].startswith("ServerDisconnectedError")


def test_max_concurrency_and_request_rate_shape_the_sends(tokenizer_dir: Path, tmp_path: Path) -> None:
    with FakeOpenAIServer(FakeServerConfig(ttft_s=0.03, itl_s=0.01)) as server:
        serial = _serve(
            server.base_url,
            tokenizer_dir,
            tmp_path,
            "--num-prompts",
            "4",
            "--input-len",
            "8",
            "--output-len",
            "3",
            "--max-concurrency",
            "1",
        )
        assert serial["max_concurrent_requests"] == 1
        starts = serial["start_times"]
        assert all(b - a >= 0.03 + 2 * 0.01 for a, b in zip(starts, starts[1:]))
        paced = _serve(
            server.base_url,
            tokenizer_dir,
            tmp_path,
            "--num-prompts",
            "6",
            "--input-len",
            "8",
            "--output-len",
            "2",
            "--request-rate",
            "20",
            "--seed",
            "5",
        )
    for sent, planned in zip(paced["start_times"], arrival_offsets(6, 20.0, 1.0, seed=5)):
        assert planned <= sent < planned + SLACK_S


def test_output_tokens_are_counted_with_the_tokenizer_without_usage(tokenizer_dir: Path, tmp_path: Path) -> None:
    from bench.prompt_text import load_tokenizer

    with FakeOpenAIServer(FakeServerConfig(ttft_s=0.01, itl_s=0.005, send_usage=False)) as server:
        result = _serve(
            server.base_url, tokenizer_dir, tmp_path, "--num-prompts", "2", "--input-len", "8", "--output-len", "3"
        )
    tokenizer = load_tokenizer(tokenizer_dir)
    assert result["output_lens"] == [len(tokenizer.encode(" w0 w1 w2", add_special_tokens=False))] * 2


def test_bad_api_key_fails_every_request_and_the_exit_code_says_so(tokenizer_dir: Path, tmp_path: Path) -> None:
    with FakeOpenAIServer(FakeServerConfig(api_key="right")) as server:
        args = [
            "bench",
            "serve",
            "--base-url",
            server.base_url,
            "--tokenizer",
            str(tokenizer_dir),
            "--model",
            "m",
            "--api-key",
            "wrong",
            "--num-prompts",
            "2",
            "--input-len",
            "8",
            "--output-len",
            "2",
            "--disable-tqdm",
        ]
        assert main(args) == 1
        with pytest.raises(SystemExit) as exit_info:  # no --model: listing models needs the key too
            main(args[:6] + args[8:])
        assert exit_info.value.code == 2


def test_sweep_writes_one_result_per_rate_and_plots_them(
    tokenizer_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    with FakeOpenAIServer(FakeServerConfig(ttft_s=0.01, itl_s=0.005)) as server:
        args = [
            "bench",
            "sweep",
            "--base-url",
            server.base_url,
            "--tokenizer",
            str(tokenizer_dir),
            "--disable-tqdm",
            "--request-rates",
            "50,inf",
            "--num-prompts",
            "3",
            "--input-len",
            "8",
            "--output-len",
            "3",
            "--result-dir",
            str(tmp_path / "sweep"),
        ]
        assert main(args) == 0
    assert "Request Rate Sweep" in capsys.readouterr().out
    files = sorted((tmp_path / "sweep").glob("*.json"))
    results = [json.loads(f.read_text()) for f in files]
    assert sorted(str(r["request_rate"]) for r in results) == ["50.0", "inf"]
    assert {r["label"] for r in results} == {f"127.0.0.1:{server.port}"}
    assert all(r["completed"] == 3 for r in results)
    # each rate has its own prompts, so a prefix cache cannot carry one rate into the next
    prompts = [body["prompt"] for body in server.bodies]
    assert len(set(prompts)) == 6
    assert main(["bench", "plot", *map(str, files), "--output-dir", str(tmp_path / "figures")]) == 0
    assert (tmp_path / "figures" / "latency_vs_rate.png").is_file()


@pytest.mark.slow
def test_bench_serve_against_splitserve_up(tmp_path: Path) -> None:
    pytest.importorskip("ucxx")
    port = free_port()
    up = HTTPProcess(
        "up", "up", "--port", str(port), "--grpc-port", str(free_port()), "--kv-cache-memory", str(64 << 20), port=port
    )
    try:
        args = [
            "bench",
            "serve",
            "--base-url",
            up.url,
            "--num-prompts",
            "4",
            "--input-len",
            "32",
            "--output-len",
            "8",
            "--disable-tqdm",
            "--save-result",
            "--result-dir",
            str(tmp_path),
            "--result-filename",
            "up.json",
        ]
        assert main(args) == 0
        result = json.loads((tmp_path / "up.json").read_text())
        assert (result["completed"], result["failed"]) == (4, 0)
        assert result["output_lens"] == [8] * 4
        assert result["input_lens"] == [32] * 4
    finally:
        assert up.stop() == 0


def test_without_tokenizer_the_servers_model_folder_measures_prompts(
    tokenizer_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """No --tokenizer: the folder /v1/models gives as the model's root (a server on this host)."""
    with FakeOpenAIServer(FakeServerConfig(root=str(tokenizer_dir))) as server:
        main(
            [
                "bench",
                "serve",
                "--base-url",
                server.base_url,
                "--disable-tqdm",
                "--num-prompts",
                "2",
                "--input-len",
                "12",
                "--output-len",
                "2",
                "--num-warmups",
                "0",
                "--save-result",
                "--result-dir",
                str(tmp_path),
                "--result-filename",
                "r.json",
            ]
        )
    assert json.loads((tmp_path / "r.json").read_text())["input_lens"] == [12, 12]
    with FakeOpenAIServer(FakeServerConfig()) as server, pytest.raises(SystemExit):  # no root: no way to tokenize alike
        main(["bench", "serve", "--base-url", server.base_url, "--disable-tqdm", "--num-prompts", "2"])
    error = capsys.readouterr().err
    assert "'fake-model' is no folder with a tokenizer.json or .gguf file here; pass --tokenizer PATH" in error


def test_without_tokenizer_the_embedded_models_name_measures_prompts_with_its_file(tmp_path: Path) -> None:
    """A server that names only what it serves (splitserve's root is the served name) under the
    embedded model's name: its GGUF file measures the prompts, as ``splitserve up`` serves it."""
    from engine.default_model import DEFAULT_MODEL_NAME

    with FakeOpenAIServer(FakeServerConfig(model=DEFAULT_MODEL_NAME, root=DEFAULT_MODEL_NAME)) as server:
        main(
            ["bench", "serve", "--base-url", server.base_url, "--disable-tqdm", "--num-prompts", "2", "--input-len",
             "12", "--output-len", "2", "--num-warmups", "0", "--save-result", "--result-dir", str(tmp_path),
             "--result-filename", "r.json"]
        )  # fmt: skip
    result = json.loads((tmp_path / "r.json").read_text())
    assert result["input_lens"] == [12, 12] and result["tokenizer_id"].endswith(".gguf")
