"""Bad input raises ValueError with the reason, and the engine keeps serving."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from engine import LLM, SamplingParams
from engine.config import EngineConfig
from engine.context_length import ContextLengthExceeded, resolve_max_tokens
from tests.checkpoints import make_checkpoint


@pytest.fixture(scope="module")
def llm(tmp_path_factory: pytest.TempPathFactory) -> LLM:
    path = make_checkpoint(tmp_path_factory.mktemp("llama"), max_position_embeddings=64)
    return LLM(model=str(path), kv_cache_memory=1 << 22)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_tokens": -1}, "max_tokens must be >= 1"),
        ({"max_tokens": 0}, "max_tokens must be >= 1"),
        ({"temperature": -0.5}, "temperature must be >= 0"),
        ({"top_p": 0.0}, r"top_p must be in \(0, 1\]"),
        ({"top_p": 1.5}, r"top_p must be in \(0, 1\]"),
        ({"top_k": -2}, "top_k must be >= 0"),
        ({"min_p": 2.0}, r"min_p must be in \[0, 1\]"),
        ({"min_tokens": 5, "max_tokens": 2}, "min_tokens must be <= max_tokens"),
        ({"repetition_penalty": 0.0}, "repetition_penalty must be > 0"),
        ({"logprobs": 50}, r"logprobs must be in \[0, 20\]"),
    ],
)
def test_sampling_params_reject_bad_values(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)  # type: ignore[arg-type]


def test_resolve_max_tokens_fills_or_checks_the_context() -> None:
    assert resolve_max_tokens(10, None, 64) == 54
    assert resolve_max_tokens(10, 54, 64) == 54
    with pytest.raises(ContextLengthExceeded, match="prompt has 64 tokens") as too_long:
        resolve_max_tokens(64, None, 64)
    assert too_long.value.param == "prompt"
    with pytest.raises(ContextLengthExceeded, match="lower max_completion_tokens") as too_many:
        resolve_max_tokens(10, 55, 64, "max_completion_tokens")
    assert too_many.value.param == "max_completion_tokens"


def test_bad_prompts_raise_and_leave_the_engine_serving(llm: LLM) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=4)
    with pytest.raises(ValueError, match="prompt is empty"):
        llm.generate([[5, 6], []], params)
    with pytest.raises(ValueError, match="maximum context length is 64 tokens, but the prompt has 64 tokens"):
        llm.generate([[5] * 64], params)
    with pytest.raises(ValueError, match="maximum context length is 64 tokens, but 70 were requested"):
        llm.generate([[5] * 10], SamplingParams(max_tokens=60))
    with pytest.raises(ValueError, match=r"token ids must be in \[0, 512\)"):
        llm.generate([[5, 9999]], params)
    with pytest.raises(ValueError, match="2 SamplingParams for 1 prompts"):
        llm.generate([[5]], [params, params])
    report = llm.engine.load_report()
    assert report.num_waiting == report.num_running == 0
    assert report.num_free_blocks == report.num_total_blocks
    (output,) = llm.generate([[5, 6, 7]], params)
    assert len(output.outputs[0].token_ids) == 4


def test_max_tokens_none_fills_the_context(llm: LLM) -> None:
    (output,) = llm.generate([[5] * 60], SamplingParams(temperature=0.0, max_tokens=None, ignore_eos=True))
    assert len(output.outputs[0].token_ids) == 4 and output.outputs[0].finish_reason == "length"


def test_unsupported_architecture_is_named(tmp_path: Path) -> None:
    path = make_checkpoint(tmp_path / "m")
    config = json.loads((path / "config.json").read_text())
    config["architectures"] = ["GPT2LMHeadModel"]
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="supported: LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM"):
        LLM(model=str(path))


def test_model_folder_must_exist(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="with config.json, or a .gguf file; .* is neither"):
        LLM(model=str(tmp_path))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"block_size": 12}, "power of two"),
        ({"max_num_seqs": 0}, "max_num_seqs"),
        ({"role": "both"}, "role must be one of"),
        ({"long_prefill_token_threshold": 1}, "long_prefill_token_threshold must be a token count >= 2"),
        ({"long_prefill_token_threshold": "half"}, "'auto' or None"),
    ],
)
def test_engine_config_rejects_bad_values(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        EngineConfig(**kwargs)  # type: ignore[arg-type]


def test_stop_strings_and_logprobs_through_the_offline_api(llm: LLM) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=2)
    (plain,) = llm.generate([[5, 6, 7]], params)
    completion = plain.outputs[0]
    assert len(completion.logprobs) == 8
    assert all(
        lp.token_id == t and len(lp.top_logprobs) == 2 for lp, t in zip(completion.logprobs, completion.token_ids)
    )
    assert all(lp.rank == 1 for lp in completion.logprobs)  # greedy picks the most likely token
    text = completion.text
    # Stop at two characters of the greedy text past its first (so that the stopped text is not
    # empty), not whitespace alone: the model is seeded, so the same ones every run.
    start = next((i for i in range(1, len(text) - 1) if text[i : i + 2].strip()), None)
    assert start is not None, f"the greedy text {text!r} has nowhere to stop; give the test another prompt"
    stop = text[start : start + 2]
    (stopped,) = llm.generate([[5, 6, 7]], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, stop=[stop]))
    assert stopped.outputs[0].finish_reason == "stop"
    assert stopped.outputs[0].stop_reason == stop
    assert stopped.outputs[0].text == text[: text.index(stop)]
    report = llm.engine.load_report()
    assert report.num_free_blocks == report.num_total_blocks
