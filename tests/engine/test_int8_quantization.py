"""``--quantization int8``: a float checkpoint's weights quantized at load to int8 rows, per output
channel (engine/models/int8_quantize.py), kept int8 in memory, served by the quantized kernels.

The tiny checkpoints are tests/checkpoints.py's. Two references: the float32 model itself
(greedy agreement, measured: int8 rounding moves the logits), and the float model of the
int8-rounded weights, which the quantized one must equal token for token (only summation
order differs): the kernels and the loader, checked apart from the rounding they serve.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine import cpu_kernels
from engine.llm import LLM
from engine.models.int8_quantize import quantize_int8
from engine.models.quantized_linear import QuantizedEmbedding, QuantizedLinear
from engine.sampling_params import SamplingParams
from tests.checkpoints import make_checkpoint, random_prompts
from tests.engine.gguf_checkpoints import Q, make_gguf, uniform

pytestmark = pytest.mark.skipif(cpu_kernels.load() is None, reason="no C compiler: nothing stays quantized")

GREEDY = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
PROMPTS = random_prompts([5, 17, 40, 9], seed=3)
SMALL_KV = {"kv_cache_memory": 1 << 22, "dtype": "float32"}


def greedy(path: Path, prompts: list[list[int]] = PROMPTS, **config: object) -> list[list[int]]:
    with LLM(model=str(path), **{**SMALL_KV, **config}) as llm:
        return [output.outputs[0].token_ids for output in llm.generate(prompts, GREEDY)]


def int8_rounded(folder: Path, target: Path) -> Path:
    """``folder`` with every 2-D weight replaced by its int8 rounding, dequantized: the float
    model the int8 one computes."""
    shutil.copytree(folder, target)
    weights = load_file(str(folder / "model.safetensors"))
    rounded = {name: quantize_int8(w).dequantize() if w.dim() == 2 else w for name, w in weights.items()}
    save_file(rounded, str(target / "model.safetensors"))
    return target


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("llama"), "LlamaForCausalLM")


@pytest.mark.parametrize("architecture", ["LlamaForCausalLM", "Qwen2ForCausalLM"])
def test_int8_equals_the_float_model_of_its_rounded_weights(tmp_path: Path, architecture: str) -> None:
    """Qwen2: tied embeddings and q/k/v biases; Llama: an untied head."""
    folder = make_checkpoint(tmp_path / "float", architecture)
    assert greedy(folder, quantization="int8") == greedy(int8_rounded(folder, tmp_path / "rounded"))


def test_int8_greedy_output_agrees_with_float32(llama: Path) -> None:
    """int8 rounding moves each weight by at most half a step (1/254 of its row's largest). The
    tiny random model is touchy (its top two logits are often close): over 30 prompts int8 keeps
    the first token of 80% and 54% of 16 free-running tokens (a sequence parts for good at its
    first differing token), where Q8_0 weights, finer (a scale per 32), keep 90% and 42%."""
    prompts = random_prompts([5, 17, 40] * 10, seed=1)
    quantized, expected = greedy(llama, prompts, quantization="int8"), greedy(llama, prompts)
    first_tokens = sum(got[0] == want[0] for got, want in zip(quantized, expected, strict=True))
    assert first_tokens / len(prompts) >= 0.75
    agreeing = sum(a == b for got, want in zip(quantized, expected, strict=True) for a, b in zip(got, want))
    assert agreeing / sum(map(len, expected)) >= 0.4


@pytest.mark.slow
def test_the_embedded_smollm2_in_int8_answers_as_in_float32() -> None:
    from engine.default_model import default_model_path

    question = [{"role": "user", "content": "What is the capital of France?"}]
    params = SamplingParams(max_tokens=12, temperature=0)
    answers = []
    for quantization in ("int8", None):
        with LLM(model=str(default_model_path()), quantization=quantization, **SMALL_KV) as llm:
            answers.append(llm.chat(question, params).outputs[0])
    quantized, folder = answers
    assert "Paris" in quantized.text
    assert quantized.token_ids[:8] == folder.token_ids[:8]


def test_the_weights_are_int8_in_memory(llama: Path) -> None:
    """Every 2-D weight is one byte an element and a float32 scale a row; only the norms stay float."""
    weights = load_file(str(llama / "model.safetensors"))
    with LLM(model=str(llama), quantization="int8", **SMALL_KV) as llm:
        model = llm.engine.runner.model
        assert isinstance(model.embed_tokens, QuantizedEmbedding)
        modules = [m for m in model.modules() if isinstance(m, QuantizedLinear | QuantizedEmbedding)]
        quantized = {id(m.qweight): m.qweight for m in modules}
        assert {weight.format.name for weight in quantized.values()} == {"INT8"}
        assert all(weight.data.dtype == torch.uint8 for weight in quantized.values())
        expected = sum(w.shape[0] * (w.shape[1] + 4) for w in weights.values() if w.dim() == 2)
        assert sum(weight.nbytes for weight in quantized.values()) == expected
        floats = sum(param.numel() * param.element_size() for param in model.parameters())
        assert floats == sum(w.numel() * 4 for w in weights.values() if w.dim() == 1)  # the norms, float32
    # A quarter of float32's bytes, and 4 more a row: (64 + 4) / (4 * 64) on this narrow model.
    assert expected + floats < 0.28 * sum(w.numel() * 4 for w in weights.values())


def test_int8_over_tensor_parallel_ranks_equals_one_rank(llama: Path) -> None:
    """A row's scale holds for any of its columns: ranks split o_proj and down_proj by columns."""
    assert greedy(llama, quantization="int8", tensor_parallel_size=2) == greedy(llama, quantization="int8")


def test_a_gguf_file_refuses_int8(tmp_path: Path) -> None:
    checkpoint = make_gguf(tmp_path, uniform(Q.Q8_0))
    with pytest.raises(ValueError, match="quantized already"):
        LLM(model=str(checkpoint.path), quantization="int8", **SMALL_KV)


def test_an_unknown_quantization_is_refused(llama: Path) -> None:
    with pytest.raises(ValueError, match="quantization must be int8"):
        LLM(model=str(llama), quantization="int4", **SMALL_KV)


def test_the_flag_reaches_generate_and_the_instances(llama: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import argparse

    from engine_args.flags import add_engine_arguments, engine_argv
    from splitserve.cli import main

    flags = ["--kv-cache-memory", str(1 << 22), "--dtype", "float32", "--max-tokens", "6", "--raw"]
    assert main(["generate", "--model", str(llama), "--quantization", "int8", *flags, "hello world"]) == 0
    with LLM(model=str(llama), quantization="int8", **SMALL_KV) as llm:
        expected = llm.generate(["hello world"], SamplingParams(temperature=0.0, max_tokens=6))[0].outputs[0].text
    assert capsys.readouterr().out.splitlines() == [expected.strip()]
    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    argv = engine_argv(parser.parse_args(["--quantization", "int8"]))
    assert argv[argv.index("--quantization") + 1] == "int8"
    assert "--quantization" not in engine_argv(parser.parse_args([]))
