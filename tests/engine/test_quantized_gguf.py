"""GGUF files load with their Q4_0, Q4_1, Q8_0, Q4_K, Q5_K and Q6_K weights kept quantized, and
generate what the float model of their dequantized weights generates.

The tiny GGUFs are written here (tests/engine/gguf_checkpoints.py) from random Llama and Qwen2
models, beside a Hugging Face folder of the same weights dequantized by ``gguf`` itself; the
embedded SmolLM2 GGUF is compared with the dequantized safetensors folder it is served from
today (engine/default_model.py).
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from engine import cpu_kernels
from engine.engine_core import resolve_model_path
from engine.gguf_files import metadata_folder
from engine.llm import LLM
from engine.models.cpu_linear import PackedLinear
from engine.models.quantized_linear import (
    MixedQuantizedLinear,
    QuantizedEmbedding,
    QuantizedLinear,
)
from engine.sampling_params import SamplingParams
from kv_connector.fingerprint import model_identity
from tests.checkpoints import random_prompts
from tests.engine.gguf_checkpoints import K_QUANT_MODEL, GGUFCheckpoint, Q, make_gguf, mixed_qkv, q4_k_m, uniform

pytestmark = pytest.mark.skipif(cpu_kernels.load() is None, reason="no C compiler: nothing stays quantized")

GREEDY = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
PROMPTS = random_prompts([5, 17, 40], seed=1)
# float32, the exact reference: under auto a GGUF file runs in bf16 where the CPU has bf16 dot products.
SMALL_KV = {"kv_cache_memory": 1 << 22, "dtype": "float32"}


def greedy(path: Path, prompts: list[list[int]] = PROMPTS, **config: object) -> list[list[int]]:
    with LLM(model=str(path), **{**SMALL_KV, **config}) as llm:
        return [output.outputs[0].token_ids for output in llm.generate(prompts, GREEDY)]


@pytest.fixture(scope="module")
def tied_q4_1(tmp_path_factory: pytest.TempPathFactory) -> GGUFCheckpoint:
    """SmolLM2's layout: Q4_1 layers, a Q8_0 embedding the head is tied to."""
    return make_gguf(tmp_path_factory.mktemp("tied"), uniform(Q.Q4_1, Q.Q8_0), tie_word_embeddings=True)


SCHEMES = {
    "q4_0-untied": (uniform(Q.Q4_0), "LlamaForCausalLM", {}),
    "q8_0-untied": (uniform(Q.Q8_0), "LlamaForCausalLM", {}),
    "q4_1-f16-embedding": (uniform(Q.Q4_1, Q.F16), "LlamaForCausalLM", {"tie_word_embeddings": True}),
    "qwen2-q4_1-biases": (uniform(Q.Q4_1), "Qwen2ForCausalLM", {}),
    "mixed-qkv": (mixed_qkv, "LlamaForCausalLM", {}),
    "q4_k-untied": (uniform(Q.Q4_K), "LlamaForCausalLM", K_QUANT_MODEL),
    "q5_k-tied": (uniform(Q.Q5_K), "LlamaForCausalLM", {**K_QUANT_MODEL, "tie_word_embeddings": True}),
    "q6_k-untied": (uniform(Q.Q6_K), "LlamaForCausalLM", K_QUANT_MODEL),
    "q4_k_m-mix": (q4_k_m, "LlamaForCausalLM", K_QUANT_MODEL),
    "qwen2-q4_k-biases": (uniform(Q.Q4_K), "Qwen2ForCausalLM", K_QUANT_MODEL),
}


@pytest.fixture(scope="module")
def k_quant_mix(tmp_path_factory: pytest.TempPathFactory) -> GGUFCheckpoint:
    """llama.cpp's Q4_K_M mix: Q4_K and Q6_K, q/k/v mixing the two."""
    return make_gguf(tmp_path_factory.mktemp("q4_k_m"), q4_k_m, **K_QUANT_MODEL)


@pytest.mark.parametrize("scheme", SCHEMES)
def test_greedy_output_equals_the_dequantized_float_model(tmp_path: Path, scheme: str) -> None:
    quantize, architecture, overrides = SCHEMES[scheme]
    checkpoint = make_gguf(tmp_path, quantize, architecture, **overrides)
    assert greedy(checkpoint.path) == greedy(checkpoint.dequantized)


def test_the_tied_model_keeps_its_weights_quantized_and_equals_the_float_model(tied_q4_1: GGUFCheckpoint) -> None:
    with LLM(model=str(tied_q4_1.path), **SMALL_KV) as llm:
        model = llm.engine.runner.model
        assert isinstance(model.embed_tokens, QuantizedEmbedding)
        assert model.embed_tokens.qweight.format.name == "Q8_0"
        # The head multiplies by the embedding's own blocks.
        assert model.lm_head.qweight is model.embed_tokens.qweight
        for layer in model.layers:
            for name in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"):
                linear = getattr(layer, name)
                assert isinstance(linear, QuantizedLinear) and linear.qweight.format.name == "Q4_1"
        assert model.layers[0].qkv_proj.qweight.shape == (64 + 2 * 32, 64)  # q, k, v rows fused
        assert not any(param.dtype == torch.uint8 or param.is_meta for param in model.parameters())
        outputs = [output.outputs[0].token_ids for output in llm.generate(PROMPTS, GREEDY)]
    assert outputs == greedy(tied_q4_1.dequantized)


def test_a_fused_group_of_two_formats_stays_quantized_one_call_per_format(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    checkpoint = make_gguf(tmp_path, mixed_qkv)
    with (
        caplog.at_level(logging.INFO, "engine.models.quantized_model"),
        LLM(model=str(checkpoint.path), **SMALL_KV) as llm,
    ):
        layer = llm.engine.runner.model.layers[0]
        assert isinstance(layer.qkv_proj, MixedQuantizedLinear)
        # Q's rows in Q4_0, then K's and V's fused in Q8_0.
        assert [(part.qweight.format.name, part.out_features) for part in layer.qkv_proj.parts] == [
            ("Q4_0", 64),
            ("Q8_0", 64),
        ]
        assert isinstance(layer.gate_up_proj, QuantizedLinear)
        assert not any(isinstance(module, PackedLinear) for module in llm.engine.runner.model.modules())
    assert "layers.0.qkv_proj mixes formats" in caplog.text


def test_the_k_quant_mix_keeps_every_weight_quantized_and_equals_the_float_model(
    k_quant_mix: GGUFCheckpoint,
) -> None:
    with LLM(model=str(k_quant_mix.path), **SMALL_KV) as llm:
        model = llm.engine.runner.model
        assert isinstance(model.embed_tokens, QuantizedEmbedding)
        assert model.embed_tokens.qweight.format.name == "Q6_K"
        assert model.lm_head.qweight.format.name == "Q6_K"
        for layer in model.layers:
            assert [(part.qweight.format.name, part.out_features) for part in layer.qkv_proj.parts] == [
                ("Q4_K", 256 + 128),  # q and k fused
                ("Q6_K", 128),
            ]
            assert layer.gate_up_proj.qweight.format.name == "Q4_K"
            assert layer.o_proj.qweight.format.name == "Q4_K"
            assert layer.down_proj.qweight.format.name == "Q6_K"
        assert not any(param.dim() == 2 for param in model.parameters())  # only the norms are float
        outputs = [output.outputs[0].token_ids for output in llm.generate(PROMPTS, GREEDY)]
    assert outputs == greedy(k_quant_mix.dequantized)


def test_q8_k_activations_agree_with_the_float_model(k_quant_mix: GGUFCheckpoint) -> None:
    """K-quants with their inputs rounded to Q8_K (llama.cpp's pairing): one scale per 256 inputs
    rounds coarser than Q8_0's per 32. Over 30 prompts the first token of every one holds, and
    of 16 free-running tokens 47% (a sequence parts for good at its first differing token; the
    same model in Q4_0 with Q8_0 inputs keeps 70%)."""
    prompts = random_prompts([5, 17, 40] * 10, seed=1)
    quantized = greedy(k_quant_mix.path, prompts, quant_activations="q8")
    expected = greedy(k_quant_mix.dequantized, prompts)
    assert [tokens[0] for tokens in quantized] == [tokens[0] for tokens in expected]
    agreeing = sum(a == b for got, want in zip(quantized, expected, strict=True) for a, b in zip(got, want))
    assert agreeing / sum(map(len, expected)) >= 0.4


def test_tensor_parallel_shards_k_quant_rows_and_super_block_columns(tmp_path: Path) -> None:
    """At 2 ranks of a 512-wide model every column split is a whole super-block: o_proj's 256
    columns (4 heads of 64), down_proj's 512."""
    wide = {**K_QUANT_MODEL, "hidden_size": 512, "intermediate_size": 1024, "num_attention_heads": 8}
    checkpoint = make_gguf(tmp_path, q4_k_m, **wide)
    assert greedy(checkpoint.path, tensor_parallel_size=2) == greedy(checkpoint.path)


def test_a_column_split_inside_a_super_block_is_refused(k_quant_mix: GGUFCheckpoint) -> None:
    """At 2 ranks of the 256-wide model o_proj's input splits into 128 features: half a super-block."""
    with pytest.raises(ValueError, match="whole 256-element blocks"):
        LLM(model=str(k_quant_mix.path), tensor_parallel_size=2, **SMALL_KV)


def test_q8_activations_agree_with_the_float_model(tied_q4_1: GGUFCheckpoint) -> None:
    """Rounding the activations to 8 bits moves each linear layer's output by about 0.5%: the
    first token of each prompt holds here, and most of what follows."""
    quantized = greedy(tied_q4_1.path, quant_activations="q8")
    expected = greedy(tied_q4_1.dequantized)
    assert [tokens[0] for tokens in quantized] == [tokens[0] for tokens in expected]
    agreeing = sum(a == b for got, want in zip(quantized, expected, strict=True) for a, b in zip(got, want))
    assert agreeing / sum(map(len, expected)) >= 0.5


def test_without_native_kernels_every_weight_is_dequantized_at_load(
    tied_q4_1: GGUFCheckpoint, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SPLITSERVE_CPU_KERNELS", "0")
    with LLM(model=str(tied_q4_1.path), **SMALL_KV) as llm:
        model = llm.engine.runner.model
        assert not any(isinstance(m, QuantizedLinear | QuantizedEmbedding) for m in model.modules())
        outputs = [output.outputs[0].token_ids for output in llm.generate(PROMPTS, GREEDY)]
    assert outputs == greedy(tied_q4_1.dequantized)


def test_tensor_parallel_shards_quantized_rows_and_block_columns(tied_q4_1: GGUFCheckpoint) -> None:
    """At 2 ranks every split falls on whole blocks: o_proj's 32 columns, down_proj's 64."""
    assert greedy(tied_q4_1.path, tensor_parallel_size=2) == greedy(tied_q4_1.path)


def test_a_column_split_inside_a_block_is_refused(tied_q4_1: GGUFCheckpoint) -> None:
    """At 4 ranks each takes one head of 16 features of o_proj's input: half a block."""
    with pytest.raises(ValueError, match="whole 32-element blocks"):
        LLM(model=str(tied_q4_1.path), tensor_parallel_size=4, **SMALL_KV)


def test_the_metadata_folder_holds_the_config_and_tokenizer(tied_q4_1: GGUFCheckpoint) -> None:
    from transformers import AutoConfig, AutoTokenizer

    folder = metadata_folder(tied_q4_1.path)
    assert folder == metadata_folder(tied_q4_1.path)  # derived once
    config = AutoConfig.from_pretrained(str(folder))
    assert config.architectures == ["LlamaForCausalLM"]
    assert (config.hidden_size, config.num_key_value_heads, config.tie_word_embeddings) == (64, 2, True)
    text = "The quick brown fox jumps over the lazy dog."
    original = AutoTokenizer.from_pretrained(str(tied_q4_1.dequantized))
    assert AutoTokenizer.from_pretrained(str(folder)).encode(text) == original.encode(text)
    assert metadata_folder(tied_q4_1.dequantized) == tied_q4_1.dequantized


def test_model_identity_names_the_file_and_tells_files_apart(tmp_path: Path, tied_q4_1: GGUFCheckpoint) -> None:
    identity = model_identity(tied_q4_1.path)
    assert identity.startswith("model.gguf-") and identity == model_identity(tied_q4_1.path)
    other = make_gguf(tmp_path, uniform(Q.Q4_1, Q.Q8_0), seed=1, tie_word_embeddings=True)
    assert model_identity(other.path) != identity


def test_splitserve_generate_takes_a_gguf_file(tied_q4_1: GGUFCheckpoint, capsys: pytest.CaptureFixture[str]) -> None:
    from splitserve.cli import main

    flags = ["--kv-cache-memory", str(1 << 22), "--max-tokens", "6", "--raw"]
    assert main(["generate", "--model", str(tied_q4_1.path), *flags, "hello world", "one two"]) == 0
    with LLM(model=str(tied_q4_1.dequantized), **SMALL_KV) as llm:
        outputs = llm.generate(["hello world", "one two"], SamplingParams(temperature=0.0, max_tokens=6))
    texts = [output.outputs[0].text.strip() for output in outputs]
    assert all(texts) and capsys.readouterr().out.splitlines() == texts


def test_model_paths_are_folders_or_gguf_files(tmp_path: Path, tied_q4_1: GGUFCheckpoint) -> None:
    assert resolve_model_path(str(tied_q4_1.path)) == tied_q4_1.path
    (tmp_path / "weights.bin").write_bytes(b"")
    with pytest.raises(ValueError, match="or a .gguf file"):
        resolve_model_path(str(tmp_path / "weights.bin"))


@pytest.mark.slow
def test_the_embedded_smollm2_gguf_answers_as_its_dequantized_folder() -> None:
    """The shipped Q4_1 file, served quantized, answers as the bf16 folder dequantized from it
    (whose weights are the same values rounded to bf16: equal over the first tokens at least)."""
    from engine.default_model import default_model_path, find_gguf

    question = [{"role": "user", "content": "What is the capital of France?"}]
    params = SamplingParams(max_tokens=12, temperature=0)
    answers = []
    for path in (find_gguf(), default_model_path()):
        with LLM(model=str(path), dtype="float32", kv_cache_memory=1 << 26) as llm:
            if path.suffix == ".gguf":
                assert isinstance(llm.engine.runner.model.layers[0].qkv_proj, QuantizedLinear)
            answers.append(llm.chat(question, params).outputs[0])
    quantized, folder = answers
    assert "Paris" in quantized.text
    assert quantized.token_ids[:8] == folder.token_ids[:8]
