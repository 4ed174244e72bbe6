"""Which form of the embedded model is served: the shipped GGUF file, kept quantized, or its
dequantized bf16 folder (``--load-format``, engine/default_model.py)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from engine import default_model
from engine.cpu_features import cpu_features
from engine.default_model import DEFAULT_MODEL_NAME, embedded_model, find_gguf, prefers_folder
from engine.engine_core import resolve_model_path


@pytest.fixture
def bf16_native(monkeypatch: pytest.MonkeyPatch) -> None:
    """A CPU with bf16 dot products (AVX512_BF16), whatever this one has."""
    features = dataclasses.replace(cpu_features(), avx512_bf16=True)
    monkeypatch.setattr("engine.cpu_features.cpu_features", lambda: features)


@pytest.fixture
def float_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """A CPU without bf16 dot products (AVX2 only, say), whatever this one has."""
    features = dataclasses.replace(cpu_features(), avx512_bf16=False, amx_bf16=False)
    monkeypatch.setattr("engine.cpu_features.cpu_features", lambda: features)


@pytest.fixture
def folder(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """Where the dequantized folder would be, without converting it here."""
    path = tmp_path / DEFAULT_MODEL_NAME
    monkeypatch.setattr(default_model, "default_model_path", lambda: path)
    return path


@pytest.mark.parametrize("cpu", ["bf16_native", "float_only"])
def test_auto_serves_the_file_as_shipped_on_any_cpu(request: pytest.FixtureRequest, cpu: str, folder: Path) -> None:
    """Where bf16 is native the file computes in bf16 (its 4-bit blocks on AVX512_BF16's dot
    products), elsewhere in float32: the faster decode either way (engine/default_model.py)."""
    request.getfixturevalue(cpu)
    assert not prefers_folder("auto", "cpu")
    assert embedded_model("auto", "auto", "cpu") == find_gguf()


@pytest.mark.usefixtures("float_only")
def test_a_dtype_named_outright_gets_the_folder_in_it(folder: Path) -> None:
    """What benchmarks and comparisons with other servers mean by ``--dtype float32``."""
    for dtype in ("float32", "bfloat16", "float16"):
        assert prefers_folder(dtype, "cpu"), dtype
        assert embedded_model("auto", dtype, "cpu") == folder


@pytest.mark.usefixtures("float_only")
def test_a_gpu_gets_the_folder(folder: Path) -> None:
    """The Triton dequantizing matmul is untested on GPUs: the folder there, whatever the CPU."""
    assert embedded_model("auto", "auto", "cuda") == folder


@pytest.mark.usefixtures("bf16_native")
def test_an_explicit_form_is_served_whatever_the_cpu(folder: Path) -> None:
    assert embedded_model("gguf", "auto", "cpu") == find_gguf()
    assert embedded_model("safetensors", "float32", "cpu") == folder
    with pytest.raises(ValueError, match="load format must be one of"):
        embedded_model("pt", "auto", "cpu")  # type: ignore[arg-type]


def test_a_model_of_ones_own_must_be_the_form_named(tmp_path: Path) -> None:
    gguf = find_gguf()
    assert resolve_model_path(str(gguf), "gguf") == gguf
    with pytest.raises(ValueError, match="--load-format safetensors does not match"):
        resolve_model_path(str(gguf), "safetensors")
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ValueError, match="--load-format gguf does not match"):
        resolve_model_path(str(tmp_path), "gguf")
    assert resolve_model_path(str(tmp_path), "auto") == resolve_model_path(str(tmp_path), "safetensors") == tmp_path
