"""The official ``openai`` client against ``splitserve up`` (gateway + one prefill
+ one decode instance, the embedded SmolLM2, KV over UCX on loopback): the text
equals the offline engine's, usage counts are right, and bad requests get the
OpenAI error shape with the right status."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import grpc
import httpx
import openai
import pytest

from engine import LLM, SamplingParams
from engine.default_model import DEFAULT_MODEL_NAME
from launcher.processes import UP_STOP_TIMEOUT_S
from splitserve.v1 import generation_pb2, generation_pb2_grpc
from tests.gateway.processes import HTTPProcess
from tests.stores import free_port

pytest.importorskip("ucxx")
pytestmark = pytest.mark.slow

API_KEY = "test-key"
MAX_MODEL_LEN = 512
MAX_TOKENS = 24
PROMPTS = ["The capital of France is", "List three colours of the rainbow, separated by commas:"]
CHAT = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def stack() -> Iterator[HTTPProcess]:
    port, grpc_port = free_port(), free_port()
    up = HTTPProcess(
        "up",
        "up",
        "--port",
        str(port),
        "--grpc-port",
        str(grpc_port),
        "--api-key",
        API_KEY,
        "--max-model-len",
        str(MAX_MODEL_LEN),
        "--kv-cache-memory",
        str(64 << 20),
        # The offline engine's dtype below: auto would be bfloat16 on a CPU with bf16 dot products.
        "--dtype",
        "float32",
        port=port,
    )
    up.grpc_port = grpc_port  # type: ignore[attr-defined]
    try:
        yield up
    finally:
        children = child_pids(up.process.pid)
        assert len(children) == 3  # gateway, prefill, decode
        assert up.stop(UP_STOP_TIMEOUT_S) == 0, up.log_text()[-6000:]
        assert not [pid for pid in children if Path(f"/proc/{pid}").exists()], "splitserve up left processes behind"


def child_pids(parent: int) -> list[int]:
    pids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == parent:  # fields after the command name: state, ppid, ...
            pids.append(int(stat.parent.name))
    return pids


@pytest.fixture(scope="module")
def client(stack: HTTPProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{stack.url}/v1", api_key=API_KEY, max_retries=0)


@pytest.fixture(scope="module")
def offline() -> LLM:
    return LLM(model=None, dtype="float32", max_model_len=MAX_MODEL_LEN, kv_cache_memory=64 << 20)


def greedy(max_tokens: int = MAX_TOKENS) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens)


def test_models_lists_the_served_model(client: openai.OpenAI) -> None:
    models = client.models.list().data
    assert [m.id for m in models] == [DEFAULT_MODEL_NAME]
    # The served name, not the path it was loaded from (issue 42, item 7: how the host is laid out).
    assert models[0].root == DEFAULT_MODEL_NAME


@pytest.mark.parametrize("prompt", PROMPTS)
def test_completion_equals_offline_engine(client: openai.OpenAI, offline: LLM, prompt: str) -> None:
    expected = offline.generate([prompt], greedy())[0]
    response = client.completions.create(model=DEFAULT_MODEL_NAME, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0)
    choice = response.choices[0]
    assert response.object == "text_completion"
    assert choice.text == expected.outputs[0].text
    assert choice.finish_reason == expected.outputs[0].finish_reason
    assert response.usage.prompt_tokens == len(expected.prompt_token_ids)
    assert response.usage.completion_tokens == len(expected.outputs[0].token_ids)
    assert response.usage.total_tokens == response.usage.prompt_tokens + response.usage.completion_tokens


def test_streamed_completion_equals_offline_engine(client: openai.OpenAI, offline: LLM) -> None:
    expected = offline.generate([PROMPTS[1]], greedy())[0]
    chunks = list(
        client.completions.create(
            model=DEFAULT_MODEL_NAME,
            prompt=PROMPTS[1],
            max_tokens=MAX_TOKENS,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == expected.outputs[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == expected.outputs[0].finish_reason
    usage = chunks[-1].usage
    assert chunks[-1].choices == [] and usage is not None
    assert (usage.prompt_tokens, usage.completion_tokens) == (
        len(expected.prompt_token_ids),
        len(expected.outputs[0].token_ids),
    )


def test_chat_equals_offline_engine(client: openai.OpenAI, offline: LLM) -> None:
    expected = offline.chat(CHAT, greedy())
    response = client.chat.completions.create(
        model=DEFAULT_MODEL_NAME, messages=CHAT, max_tokens=MAX_TOKENS, temperature=0
    )
    assert response.object == "chat.completion"
    message = response.choices[0].message
    assert message.role == "assistant" and message.content == expected.outputs[0].text
    assert "Paris" in message.content
    assert response.usage.prompt_tokens == len(expected.prompt_token_ids)
    assert response.usage.completion_tokens == len(expected.outputs[0].token_ids)


def test_streamed_chat_equals_offline_engine(client: openai.OpenAI, offline: LLM) -> None:
    expected = offline.chat(CHAT, greedy())
    chunks = list(
        client.chat.completions.create(
            model=DEFAULT_MODEL_NAME,
            messages=CHAT,
            max_completion_tokens=MAX_TOKENS,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected.outputs[0].text
    assert chunks[-1].usage.completion_tokens == len(expected.outputs[0].token_ids)


def test_stop_string_ends_the_text(client: openai.OpenAI, offline: LLM) -> None:
    full = offline.generate([PROMPTS[1]], greedy())[0].outputs[0].text
    stop = full.strip()[3:5]  # two characters from inside the greedy text
    response = client.completions.create(
        model=DEFAULT_MODEL_NAME, prompt=PROMPTS[1], max_tokens=MAX_TOKENS, temperature=0, stop=[stop]
    )
    choice = response.choices[0]
    assert choice.finish_reason == "stop"
    assert choice.text == full[: full.index(stop)]


def test_logprobs(client: openai.OpenAI) -> None:
    response = client.completions.create(
        model=DEFAULT_MODEL_NAME, prompt=PROMPTS[0], max_tokens=5, temperature=0, logprobs=2
    )
    logprobs = response.choices[0].logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == len(logprobs.top_logprobs) == 5
    assert "".join(logprobs.tokens) == response.choices[0].text
    # Greedy: the sampled token is the most likely one.
    for token, logprob, top in zip(logprobs.tokens, logprobs.token_logprobs, logprobs.top_logprobs, strict=True):
        assert len(top) <= 2 and max(top.values()) == pytest.approx(logprob, abs=1e-4) and token in top
    chat = client.chat.completions.create(
        model=DEFAULT_MODEL_NAME, messages=CHAT, max_tokens=4, temperature=0, logprobs=True, top_logprobs=3
    )
    content = chat.choices[0].logprobs.content
    assert len(content) == 4 and all(len(entry.top_logprobs) == 3 for entry in content)


def test_grpc_generate_equals_rest(stack: HTTPProcess, client: openai.OpenAI) -> None:
    rest = client.completions.create(model=DEFAULT_MODEL_NAME, prompt=PROMPTS[0], max_tokens=MAX_TOKENS, temperature=0)
    with grpc.insecure_channel(f"127.0.0.1:{stack.grpc_port}") as channel:  # type: ignore[attr-defined]
        stub = generation_pb2_grpc.GenerationStub(channel)
        request = generation_pb2.GenerateRequest(
            text=PROMPTS[0], sampling=generation_pb2.SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
        )
        responses = list(stub.Generate(request, metadata=[("authorization", f"Bearer {API_KEY}")], timeout=60))
        with pytest.raises(grpc.RpcError) as refused:
            list(stub.Generate(request, timeout=10))
    assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert "".join(r.text for r in responses) == rest.choices[0].text
    final = responses[-1]
    assert final.finish_reason == "length" and final.usage.completion_tokens == MAX_TOKENS
    assert final.usage.prompt_tokens == rest.usage.prompt_tokens
    assert 0 < final.timings.ttft_s <= final.timings.e2e_s


# ----------------------------------------------------------------- errors


def _error(response: httpx.Response, status: int) -> dict[str, object]:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    return error


def test_unauthorized(stack: HTTPProcess) -> None:
    body = {"model": DEFAULT_MODEL_NAME, "prompt": "hi"}
    _error(httpx.post(f"{stack.url}/v1/completions", json=body), 401)
    error = _error(httpx.post(f"{stack.url}/v1/completions", json=body, headers={"Authorization": "Bearer wrong"}), 401)
    assert error["type"] == "authentication_error"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{stack.url}/v1", api_key="wrong", max_retries=0).models.list()
    assert httpx.get(f"{stack.url}/health").status_code == 200  # probes stay open


def test_bad_requests_get_400(stack: HTTPProcess, client: openai.OpenAI) -> None:
    headers = {"Authorization": f"Bearer {API_KEY}"}
    url = f"{stack.url}/v1/completions"
    too_long = _error(
        httpx.post(url, headers=headers, json={"model": DEFAULT_MODEL_NAME, "prompt": "hello " * 600}), 400
    )
    assert too_long["code"] == "context_length_exceeded" and str(MAX_MODEL_LEN) in str(too_long["message"])
    too_many = _error(
        httpx.post(url, headers=headers, json={"model": DEFAULT_MODEL_NAME, "prompt": "hi", "max_tokens": 1000}), 400
    )
    assert too_many["param"] == "max_tokens"
    bad_value = _error(
        httpx.post(url, headers=headers, json={"model": DEFAULT_MODEL_NAME, "prompt": "hi", "temperature": -1}), 400
    )
    assert bad_value["param"] == "temperature"
    wrong_type = _error(
        httpx.post(url, headers=headers, json={"model": DEFAULT_MODEL_NAME, "prompt": "hi", "max_tokens": "many"}), 400
    )
    assert wrong_type["param"] == "max_tokens"
    malformed = _error(
        httpx.post(url, headers={**headers, "Content-Type": "application/json"}, content=b'{"prompt": "hi"'), 400
    )
    assert "JSON" in str(malformed["message"])
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=DEFAULT_MODEL_NAME, messages=CHAT, n=2)
    # Unknown fields are accepted (and logged), as benchmark tools send them.
    ok = httpx.post(
        url, headers=headers, json={"model": DEFAULT_MODEL_NAME, "prompt": "hi", "max_tokens": 2, "some_tool_field": 1}
    )
    assert ok.status_code == 200, ok.text


def test_unknown_model_gets_404(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as raised:
        client.completions.create(model="no-such-model", prompt="hi", max_tokens=2)
    assert raised.value.body["code"] == "model_not_found"  # type: ignore[index]


def test_tokenize_detokenize_and_metrics(stack: HTTPProcess, offline: LLM) -> None:
    headers = {"Authorization": f"Bearer {API_KEY}"}
    tokens = httpx.post(f"{stack.url}/tokenize", headers=headers, json={"prompt": PROMPTS[0]}).json()
    assert tokens["tokens"] == offline.tokenizer.encode(PROMPTS[0]) and tokens["count"] == len(tokens["tokens"])
    assert tokens["max_model_len"] == MAX_MODEL_LEN  # as the instances report it
    text = httpx.post(f"{stack.url}/detokenize", headers=headers, json={"tokens": tokens["tokens"]}).json()
    assert text["prompt"] == PROMPTS[0]
    chat = httpx.post(f"{stack.url}/tokenize", headers=headers, json={"messages": CHAT}).json()
    assert (
        chat["tokens"]
        == offline.tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=True, return_dict=True)[
            "input_ids"
        ]
    )
    metrics = httpx.get(f"{stack.url}/metrics").text
    for name in (
        "splitserve_time_to_first_token_seconds_count",
        "splitserve_inter_token_latency_seconds_count",
        "splitserve_e2e_request_latency_seconds_count",
        "splitserve_request_queue_time_seconds_count",
        'splitserve_requests_total{status="length"}',
        "splitserve_generation_tokens_total",
        "splitserve_kv_transfer_bytes_total",
        "splitserve_instance_num_running{",
        "splitserve_instance_prefix_cache_hit_rate{",
    ):
        assert name in metrics, name


def test_several_prompts_in_one_request(client: openai.OpenAI, offline: LLM) -> None:
    expected = offline.generate(PROMPTS, greedy(8))
    response = client.completions.create(model=DEFAULT_MODEL_NAME, prompt=PROMPTS, max_tokens=8, temperature=0)
    assert [c.index for c in response.choices] == [0, 1]
    assert [c.text for c in response.choices] == [e.outputs[0].text for e in expected]
    assert response.usage.prompt_tokens == sum(len(e.prompt_token_ids) for e in expected)
    streamed = ["", ""]
    for chunk in client.completions.create(
        model=DEFAULT_MODEL_NAME, prompt=PROMPTS, max_tokens=8, temperature=0, stream=True
    ):
        for choice in chunk.choices:
            streamed[choice.index] += choice.text
    assert streamed == [c.text for c in response.choices]


def test_instances_only_answer_this_runs_secret(stack: HTTPProcess) -> None:
    """``splitserve up`` made a cluster secret for this run and gave it to every child through
    its environment, never its command line (which other local users can read): the instances
    refuse calls without it."""
    from cluster.auth import METADATA_KEY, ClusterSecret
    from splitserve.v1 import disaggregation_pb2, disaggregation_pb2_grpc

    secrets = set()
    for pid in child_pids(stack.process.pid):
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        environ = dict(
            item.split(b"=", 1) for item in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0") if b"=" in item
        )
        secret = environ[b"SPLITSERVE_CLUSTER_SECRET"].decode()
        secrets.add(secret)
        assert not any(secret in arg.decode() for arg in argv) and b"--cluster-secret" not in argv
        if b"gateway" in argv:
            continue
        port = argv[argv.index(b"--port") + 1].decode()
        stub = disaggregation_pb2_grpc.LoadStub(grpc.insecure_channel(f"127.0.0.1:{port}"))
        with pytest.raises(grpc.RpcError) as raised:
            stub.GetLoadReport(disaggregation_pb2.LoadReportRequest(), timeout=10)
        assert raised.value.code() == grpc.StatusCode.UNAUTHENTICATED
        credential = ClusterSecret.from_text(secret).call_credential(
            "/splitserve.v1.Load/GetLoadReport",
            f"127.0.0.1:{port}",
            disaggregation_pb2.LoadReportRequest().SerializeToString(),
        )
        assert (
            stub.GetLoadReport(
                disaggregation_pb2.LoadReportRequest(), timeout=10, metadata=[(METADATA_KEY, credential)]
            ).num_total_blocks
            > 0
        )
    assert len(secrets) == 1 and len(next(iter(secrets))) >= 32, "one strong secret, the same for the whole run"


def test_each_run_gets_its_own_secret_unless_the_user_gave_one(monkeypatch: pytest.MonkeyPatch) -> None:
    from launcher.up import _cluster_secret_env

    monkeypatch.delenv("SPLITSERVE_CLUSTER_SECRET", raising=False)
    monkeypatch.delenv("SPLITSERVE_CLUSTER_SECRET_FILE", raising=False)
    first, second = _cluster_secret_env(), _cluster_secret_env()
    assert first["SPLITSERVE_CLUSTER_SECRET"] != second["SPLITSERVE_CLUSTER_SECRET"]
    monkeypatch.setenv("SPLITSERVE_CLUSTER_SECRET", "the-users-own-cluster-secret")
    assert _cluster_secret_env() == {"SPLITSERVE_CLUSTER_SECRET": "the-users-own-cluster-secret"}
    monkeypatch.setenv("SPLITSERVE_CLUSTER_SECRET", " ")
    with pytest.raises(ValueError, match="set but empty"):
        _cluster_secret_env()
    monkeypatch.setenv("SPLITSERVE_CLUSTER_SECRET_FILE", "/run/secrets/cluster_secret")
    assert _cluster_secret_env() == {}, "the children read the user's file (they inherit the variable)"
