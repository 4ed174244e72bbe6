"""Greedy output equals transformers' ``generate(do_sample=False)`` token for token.

Every request is compared with transformers run on that prompt alone, while the
engine runs them batched: varied lengths across block boundaries, chunked
prefill, prefix-cache hits and preemption under a tiny KV budget.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from engine import LLM, SamplingParams
from tests.checkpoints import make_checkpoint, random_prompts

MAX_TOKENS = 12
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


class Reference:
    """transformers on one prompt at a time, memoized (the same prompts recur across scenarios)."""

    def __init__(self, model_path: Path) -> None:
        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
        self.model.generation_config.eos_token_id = None  # the engine runs with ignore_eos
        self._cache: dict[tuple[int, ...], list[int]] = {}

    def generate_kwargs(self) -> dict[str, object]:
        """More arguments of one prompt's ``generate`` (none here; a subclass may give a cache)."""
        return {}

    def __call__(self, prompt: list[int]) -> list[int]:
        key = tuple(prompt)
        if key not in self._cache:
            with torch.inference_mode():
                out = self.model.generate(
                    torch.tensor([prompt]),
                    attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                    do_sample=False,
                    max_new_tokens=MAX_TOKENS,
                    pad_token_id=0,
                    **self.generate_kwargs(),
                )
            self._cache[key] = out[0, len(prompt) :].tolist()
        return self._cache[key]


# Lengths straddle the 16-token block boundary and multiples of it.
VARIED_LENGTHS = [1, 2, 7, 15, 16, 17, 31, 32, 33, 47, 48, 49, 64, 70, 90, 100, 5, 23]


def assert_matches(llm: LLM, prompts: list[list[int]], reference: Callable[[list[int]], list[int]]) -> None:
    outputs = llm.generate(prompts, GREEDY)
    assert len(outputs) == len(prompts)
    for prompt, output in zip(prompts, outputs, strict=True):
        assert output.prompt_token_ids == prompt
        assert output.outputs[0].token_ids == reference(prompt), f"prompt of {len(prompt)} tokens diverged"
        assert output.outputs[0].finish_reason == "length"
    assert_no_leaks(llm)


def assert_no_leaks(llm: LLM) -> None:
    report = llm.engine.load_report()
    assert report.num_free_blocks == report.num_total_blocks
    assert report.num_waiting == report.num_running == 0


@pytest.fixture(scope="module", params=["LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM"])
def checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Reference]:
    path = make_checkpoint(tmp_path_factory.mktemp(request.param), request.param)
    return path, Reference(path)


def test_batched_varied_lengths(checkpoint: tuple[Path, Reference]) -> None:
    path, reference = checkpoint
    llm = LLM(model=str(path), kv_cache_memory=1 << 24)
    assert_matches(llm, random_prompts(VARIED_LENGTHS, seed=1), reference)


def test_chunked_prefill(checkpoint: tuple[Path, Reference]) -> None:
    path, reference = checkpoint
    # A budget smaller than most prompts: prefills split into chunks, sharing steps with decodes.
    llm = LLM(model=str(path), kv_cache_memory=1 << 24, max_num_batched_tokens=24)
    assert_matches(llm, random_prompts(VARIED_LENGTHS, seed=1), reference)


def test_prefix_cache_hits(checkpoint: tuple[Path, Reference]) -> None:
    path, reference = checkpoint
    llm = LLM(model=str(path), kv_cache_memory=1 << 24)
    shared = random_prompts([40], seed=2)[0]
    suffixes = random_prompts([1, 5, 9, 16, 17, 30], seed=3)
    prompts = [shared + suffix for suffix in suffixes]
    assert_matches(llm, prompts[:1], reference)
    outputs = llm.generate(prompts[1:], GREEDY)
    for prompt, output in zip(prompts[1:], outputs, strict=True):
        assert output.num_cached_tokens == 32  # the shared prefix's two full blocks
        assert output.outputs[0].token_ids == reference(prompt)
    assert_no_leaks(llm)
    # The whole prompt is cached now, yet the last token is recomputed to sample from it.
    again = llm.generate(prompts[:1], GREEDY)[0]
    assert again.num_cached_tokens == 32
    assert again.outputs[0].token_ids == reference(prompts[0])


def test_preemption_under_tiny_kv_budget(checkpoint: tuple[Path, Reference]) -> None:
    path, reference = checkpoint
    # 10 blocks = 160 tokens of KV for 16 requests of up to 45 + 12 tokens each.
    llm = LLM(model=str(path), num_blocks_override=10, max_num_batched_tokens=64)
    prompts = random_prompts([5, 20, 33, 45, 12, 40, 8, 30, 17, 25, 44, 3, 36, 28, 15, 41], seed=4)
    assert_matches(llm, prompts, reference)
    assert llm.engine.scheduler.num_preemptions > 0


@pytest.fixture(scope="module")
def smollm2() -> tuple[LLM, Reference]:
    from engine.default_model import default_model_path

    path = default_model_path()
    return LLM(model=str(path), dtype="float32", kv_cache_memory=1 << 28), Reference(path)


@pytest.mark.slow
def test_smollm2_batched(smollm2: tuple[LLM, Reference]) -> None:
    llm, reference = smollm2
    vocab_size = llm.engine.vocab_size
    prompts = random_prompts(
        [3, 16, 17, 40, 64, 65, 100, 130, 9, 33, 50, 75, 20, 31, 48, 90], seed=5, vocab_size=vocab_size
    )
    assert_matches(llm, prompts, reference)


@pytest.mark.slow
def test_smollm2_text_prompt(smollm2: tuple[LLM, Reference]) -> None:
    llm, reference = smollm2
    text = "The capital of France is"
    output = llm.generate([text], GREEDY)[0]
    assert output.outputs[0].token_ids == reference(llm.tokenizer.encode(text))
    assert output.outputs[0].text == llm.tokenizer.decode(output.outputs[0].token_ids, skip_special_tokens=True)


def test_llama3_rope_scaling_tied_embeddings_sharded(tmp_path: Path) -> None:
    """Llama 3 style: llama3 RoPE scaling, tied embeddings, weights split over several safetensors files."""
    rope = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
        "rope_theta": 500000.0,
    }
    single = make_checkpoint(tmp_path / "llama3", tie_word_embeddings=True, rope_parameters=rope)
    model = AutoModelForCausalLM.from_pretrained(single)
    path = tmp_path / "llama3-sharded"
    model.save_pretrained(path, max_shard_size="100KB")
    AutoTokenizer.from_pretrained(single).save_pretrained(path)
    assert len(list(path.glob("*.safetensors"))) > 1 and (path / "model.safetensors.index.json").is_file()
    assert model.config.rope_parameters["rope_type"] == "llama3"
    llm = LLM(model=str(path), kv_cache_memory=1 << 22)
    # Long enough prompts that positions pass the original context, where llama3 scaling bites.
    assert_matches(llm, random_prompts([5, 70, 100], seed=6), Reference(path))


def test_float16_generates_like_transformers_on_short_prompts(tmp_path: Path) -> None:
    """float16 runs the torch reference paths on CPU; short prompts keep rounding drift out of argmax."""
    path = make_checkpoint(tmp_path / "fp16")
    llm = LLM(model=str(path), dtype="float16", kv_cache_memory=1 << 22)
    outputs = llm.generate(
        random_prompts([4, 9], seed=7), SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    )
    assert [len(o.outputs[0].token_ids) for o in outputs] == [4, 4]
    assert llm.engine.runner.dtype == torch.float16
    assert_no_leaks(llm)
