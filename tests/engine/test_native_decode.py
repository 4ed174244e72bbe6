"""A decode step in one native call (engine/models/native_decode.py) gives what the model's
modules give, bit for bit: its logits, and the K/V it writes into the paged cache.

Every step the native call takes is run through the modules too, on the same inputs,
right after it (they rewrite the step's K/V slots; a difference in either shows). The
batches mix lengths across block boundaries and sizes beyond the panel kernel's reach
(those steps, and prefills, must go to the modules). Each kernel build this CPU runs is
tested, the generic one (no SIMD) included.

Quantized weights too (GGUF's formats, written here by tests/engine/gguf_checkpoints.py, and
``--quantization int8``): each linear layer through the kernel and activation mode its module
uses, a fused projection mixing formats one call per run, a quantized embedding and the head
tied to it."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from types import UnionType

import pytest
import torch
from torch import nn

from engine import LLM, SamplingParams, cpu_kernels
from engine.cpu_features import CAP_ENV, cpu_features
from engine.flat_batch import FlatBatch
from engine.model_runner import ModelRunner
from engine.models.cpu_linear import BF16WeightLinear, PackedLinear
from engine.models.native_decode import LayerCapture, NativeDecodeStep, capture_layer_ids
from engine.models.quantized_linear import MixedQuantizedLinear, QuantizedEmbedding, QuantizedLinear
from tests.checkpoints import make_checkpoint, random_prompts
from tests.engine.gguf_checkpoints import K_QUANT_MODEL, Q, Scheme, mixed_qkv, q4_k_m, uniform, write_gguf

GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)


@pytest.fixture(params=cpu_features().supported_isas)
def isa(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch):
    """The kernel build under test, this CPU's best one and every weaker one it runs."""
    monkeypatch.setenv(CAP_ENV, request.param)
    cpu_features.cache_clear()
    cpu_kernels.clear_cache()
    yield request.param
    monkeypatch.delenv(CAP_ENV)
    cpu_features.cache_clear()
    cpu_kernels.clear_cache()


class Checked:
    """Wraps a runner's native step: each step it takes is replayed through the modules."""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self.native: NativeDecodeStep = runner.native_decode
        self.num_steps = 0
        self.row_counts: list[int] = []

    def __call__(self, batch: FlatBatch, final_hidden_out: torch.Tensor | None = None) -> torch.Tensor | None:
        if final_hidden_out is not None:
            raise AssertionError("these engines do not speculate with Medusa: no step asks for hidden states")
        logits = self.native(batch)
        if logits is None:
            return None
        self.num_steps += 1
        self.row_counts.append(batch.input_ids.shape[0])
        written = self._slots(batch).clone()
        expected = self.runner.model(
            batch.input_ids, batch.positions, self.runner.layer_caches, batch.metadata, batch.logits_indices
        )
        assert torch.equal(logits, expected), f"logits of a {batch.input_ids.shape[0]}-row step differ"
        assert torch.equal(self._slots(batch), written), "the native step wrote other K/V"
        return logits

    def _slots(self, batch: FlatBatch) -> torch.Tensor:
        """Every layer's K and V of the step's new tokens: [T, num_layers, 2, H_kv, D]."""
        slots = batch.metadata.slot_mapping
        block_size = self.runner.block_size
        return self.runner.kv_cache[slots // block_size, :, :, slots % block_size]


def checked_llm(path: Path, dtype: str, **config: object) -> tuple[LLM, Checked]:
    llm = LLM(model=str(path), dtype=dtype, kv_cache_memory=1 << 24, **config)
    runner = llm.engine.runner
    assert runner.native_decode is not None, "the native decode step should take this model"
    checked = Checked(runner)
    runner.native_decode = checked
    return llm, checked


def decode_steps_of_every_size(llm: LLM, checked: Checked, seed: int) -> None:
    """More sequences than the native step takes rows, of lengths across block boundaries: the
    first steps go to the modules, and as the requests finish one after another, the rest to
    the native call, in steps of every size down to the stragglers."""
    max_rows = checked.native.max_rows
    lengths = [1, 7, 15, 16, 17, 31, 33, 48, 5, 23, 64, 2] * (max_rows // 12 + 1)
    prompts = random_prompts(lengths[: max_rows + 3], seed=seed)
    params = [SamplingParams(temperature=0.0, max_tokens=4 + i % 9, ignore_eos=True) for i in range(len(prompts))]
    outputs = llm.generate(prompts, params)
    assert [len(o.outputs[0].token_ids) for o in outputs] == [p.max_tokens for p in params]
    assert checked.num_steps > 0 and max(checked.row_counts) <= max_rows
    assert min(checked.row_counts) < max_rows


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize(
    ("architecture", "overrides"),
    [
        ("LlamaForCausalLM", {}),
        ("Qwen2ForCausalLM", {}),  # q/k/v biases, tied head
        ("LlamaForCausalLM", {"attention_bias": True, "mlp_bias": True, "tie_word_embeddings": True}),
    ],
)
def test_native_decode_steps_equal_the_modules(
    isa: str, tmp_path: Path, dtype: str, architecture: str, overrides: dict[str, object]
) -> None:
    path = make_checkpoint(tmp_path / "model", architecture, **overrides)
    llm, checked = checked_llm(path, dtype)
    decode_steps_of_every_size(llm, checked, seed=7)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_native_steps_capture_the_layers_eagle3_drafts_fuse(tmp_path: Path, dtype: str) -> None:
    """What an EAGLE-3 draft reads of a verify step taken natively (the embeddings, a middle
    layer's input, the last layer's) equals ``run_layers_capturing`` over the modules, bit for
    bit, with the same logits; a capture of no layer leaves the step as it was."""
    path = make_checkpoint(tmp_path / "model", num_hidden_layers=4)
    llm = LLM(model=str(path), dtype=dtype, kv_cache_memory=1 << 24)
    runner = llm.engine.runner
    native, model = runner.native_decode, runner.model
    assert native is not None, "the native decode step should take this model"
    layer_ids = [0, 2, 3]
    row_counts: list[int] = []

    def capturing(batch: FlatBatch, final_hidden_out: torch.Tensor | None = None) -> torch.Tensor | None:
        rows = batch.input_ids.shape[0]
        capture = LayerCapture.of(capture_layer_ids(layer_ids), rows, model.shape.hidden_size, native.hidden_dtype)
        logits = native(batch, None, capture)
        if logits is None:
            return None
        row_counts.append(rows)
        hidden, residual, features = model.run_layers_capturing(
            batch.positions, model.embed_tokens(batch.input_ids), runner.layer_caches, batch.metadata, layer_ids
        )
        assert torch.equal(capture.out, features), f"the layers captured in a {rows}-row step differ"
        assert torch.equal(logits, model.compute_logits(hidden, residual, batch.logits_indices))
        assert torch.equal(
            native(
                batch, None, LayerCapture.of(capture_layer_ids([]), rows, model.shape.hidden_size, native.hidden_dtype)
            ),
            logits,
        )
        return logits

    runner.native_decode = capturing
    llm.generate(random_prompts([3, 17, 40], seed=11), GREEDY)
    assert row_counts and max(row_counts) == 3, row_counts


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8_e4m3"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_native_decode_steps_over_a_quantized_kv_cache_equal_the_modules(
    isa: str, tmp_path: Path, dtype: str, kv_cache_dtype: str
) -> None:
    """The native step quantizes the new K/V rows and reads the cache's 8-bit rows as the modules'
    kernels do: the same bytes written, the same logits."""
    path = make_checkpoint(tmp_path / "model", "Qwen2ForCausalLM")
    llm, checked = checked_llm(path, dtype, kv_cache_dtype=kv_cache_dtype)
    assert llm.engine.runner.kv_cache.dtype == torch.uint8
    decode_steps_of_every_size(llm, checked, seed=11)


# A GGUF scheme: (weight types, architecture, config overrides, the modules the model must hold).
ModuleKind = type[nn.Module] | UnionType
FloatPanels = PackedLinear | BF16WeightLinear
GGUF_SCHEMES: dict[str, tuple[Scheme, str, dict[str, object], tuple[ModuleKind, ...]]] = {
    "q4_0": (uniform(Q.Q4_0), "LlamaForCausalLM", {}, (QuantizedLinear, QuantizedEmbedding)),
    # SmolLM2's layout: Q4_1 layers, a Q8_0 embedding the head is tied to.
    "q4_1-tied-q8_0": (
        uniform(Q.Q4_1, Q.Q8_0),
        "LlamaForCausalLM",
        {"tie_word_embeddings": True},
        (QuantizedLinear, QuantizedEmbedding),
    ),
    "q8_0": (uniform(Q.Q8_0), "LlamaForCausalLM", {}, (QuantizedLinear, QuantizedEmbedding)),
    "q4_k": (uniform(Q.Q4_K), "LlamaForCausalLM", K_QUANT_MODEL, (QuantizedLinear, QuantizedEmbedding)),
    "q5_k-tied": (
        uniform(Q.Q5_K),
        "LlamaForCausalLM",
        {**K_QUANT_MODEL, "tie_word_embeddings": True},
        (QuantizedLinear, QuantizedEmbedding),
    ),
    "q6_k": (uniform(Q.Q6_K), "LlamaForCausalLM", K_QUANT_MODEL, (QuantizedLinear, QuantizedEmbedding)),
    # q/k/v of two formats (Q4_K, Q6_K): one kernel call per run of rows.
    "q4_k_m-mix": (q4_k_m, "LlamaForCausalLM", K_QUANT_MODEL, (MixedQuantizedLinear, QuantizedEmbedding)),
    # q/k/v of two formats and their fused bias, added once after the runs.
    "qwen2-mixed-qkv-biases": (mixed_qkv, "Qwen2ForCausalLM", {}, (MixedQuantizedLinear, QuantizedEmbedding)),
    # Quantized layers beside a float embedding and the float head tied to it (panels).
    "q4_1-f16-embedding": (
        uniform(Q.Q4_1, Q.F16),
        "LlamaForCausalLM",
        {"tie_word_embeddings": True},
        (QuantizedLinear, FloatPanels),
    ),
}


@pytest.fixture(scope="module")
def gguf_file(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """The GGUF file of a scheme of :data:`GGUF_SCHEMES`, written once for the module."""
    files: dict[str, Path] = {}

    def of(scheme: str) -> Path:
        if scheme not in files:
            weights, architecture, overrides, _ = GGUF_SCHEMES[scheme]
            directory = tmp_path_factory.mktemp(scheme)
            folder = make_checkpoint(directory / "float", architecture, **overrides)
            write_gguf(folder, directory / "model.gguf", weights, architecture, **overrides)
            files[scheme] = directory / "model.gguf"
        return files[scheme]

    return of


def assert_holds(llm: LLM, kinds: tuple[ModuleKind, ...]) -> None:
    """The model holds modules of every kind: the weights stayed as the test means them to."""
    modules = list(llm.engine.runner.model.modules())
    for kind in kinds:
        assert any(isinstance(module, kind) for module in modules), f"no {kind} in the model"


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("scheme", GGUF_SCHEMES)
def test_native_decode_steps_of_quantized_weights_equal_the_modules(
    isa: str, gguf_file: Callable[[str], Path], dtype: str, scheme: str
) -> None:
    llm, checked = checked_llm(gguf_file(scheme), dtype)
    assert_holds(llm, GGUF_SCHEMES[scheme][3])
    decode_steps_of_every_size(llm, checked, seed=13)


@pytest.mark.parametrize("scheme", ["q4_1-tied-q8_0", "q4_k_m-mix", "q8_0"])
def test_native_decode_steps_with_q8_activations_equal_the_modules(
    isa: str, gguf_file: Callable[[str], Path], scheme: str
) -> None:
    """Inputs rounded to Q8_0 blocks (Q8_K super-blocks for the K-quants) on the fly, as the modules
    were built to round them."""
    llm, checked = checked_llm(gguf_file(scheme), "float32", quant_activations="q8")
    assert any(getattr(m, "q8_activations", False) for m in llm.engine.runner.model.modules())
    decode_steps_of_every_size(llm, checked, seed=17)


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8_e4m3"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_native_decode_steps_of_quantized_weights_over_a_quantized_kv_cache_equal_the_modules(
    gguf_file: Callable[[str], Path], dtype: str, kv_cache_dtype: str
) -> None:
    llm, checked = checked_llm(gguf_file("q4_k_m-mix"), dtype, kv_cache_dtype=kv_cache_dtype)
    assert llm.engine.runner.kv_cache.dtype == torch.uint8
    decode_steps_of_every_size(llm, checked, seed=19)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize(("architecture", "activations"), [("LlamaForCausalLM", "float"), ("Qwen2ForCausalLM", "q8")])
def test_native_decode_steps_of_int8_weights_equal_the_modules(
    isa: str, tmp_path: Path, architecture: str, dtype: str, activations: str
) -> None:
    """``--quantization int8``: int8 rows with their scales, the embedding too (Llama: an untied
    head; Qwen2: its head tied to the embedding, q/k/v biases, inputs rounded to Q8_0 blocks)."""
    path = make_checkpoint(tmp_path / "model", architecture)
    llm, checked = checked_llm(path, dtype, quantization="int8", quant_activations=activations)
    assert llm.engine.runner.model.embed_tokens.qweight.format.name == "INT8"
    decode_steps_of_every_size(llm, checked, seed=23)


def test_steps_it_does_not_take_go_to_the_modules(tmp_path: Path) -> None:
    path = make_checkpoint(tmp_path / "model")
    llm, checked = checked_llm(path, "float32", max_num_batched_tokens=8)
    native = checked.native
    calls: list[tuple[int, int]] = []
    original = native.__class__.__call__

    def spy(self: NativeDecodeStep, batch: FlatBatch) -> torch.Tensor | None:
        result = original(self, batch)
        calls.append((batch.metadata.num_decodes, batch.input_ids.shape[0]))
        assert (result is not None) == (batch.metadata.num_decodes == batch.input_ids.shape[0] <= native.max_rows)
        return result

    native.__class__.__call__ = spy  # type: ignore[method-assign]
    try:
        # A 20-token prompt in 8-token chunks beside a running decode: mixed steps.
        llm.generate(random_prompts([3, 20], seed=8), GREEDY)
    finally:
        native.__class__.__call__ = original  # type: ignore[method-assign]
    assert any(num_decodes < num_rows for num_decodes, num_rows in calls), calls
    assert any(num_decodes == num_rows for num_decodes, num_rows in calls), calls


def test_no_native_step_without_the_kernels(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPLITSERVE_CPU_KERNELS", "0")
    llm = LLM(model=str(make_checkpoint(tmp_path / "model")), dtype="float32", kv_cache_memory=1 << 24)
    assert llm.engine.runner.native_decode is None
    assert len(llm.generate(random_prompts([5], seed=9), GREEDY)[0].outputs[0].token_ids) == GREEDY.max_tokens
