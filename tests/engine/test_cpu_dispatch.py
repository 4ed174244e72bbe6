"""CPU feature detection and the paths chosen from it: kernel ISA, linear path, default dtype.

An AVX2-only host (where bf16 once crashed) is reproduced two ways on any x86
CPU: its /proc/cpuinfo flags parsed as text, and ``SPLITSERVE_CPU_ISA=avx2`` plus
oneDNN's own ``ONEDNN_MAX_CPU_ISA=AVX2`` cap (under which torch refuses to pack a bf16
weight exactly as it does on that host).
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from engine import cpu_kernels
from engine.cpu_features import CAP_ENV, cap_features, cpu_features, detect, parse_cpuinfo
from engine.models import cpu_linear
from engine.models.cpu_linear import BF16WeightLinear, PackedLinear, linear_path, prepare_linears
from engine.models.loader import resolve_dtype
from tests.checkpoints import make_checkpoint, tiny_config

CPU = torch.device("cpu")
# The 2-core AMD EPYC VM: AVX2, no AVX-512.
AVX2_EPYC_FLAGS = (
    "flags\t\t: fpu vme de pse tsc msr pae mce cx8 apic sep mtrr pge mca cmov pat pse36 clflush mmx fxsr sse "
    "sse2 ht syscall nx mmxext fxsr_opt pdpe1gb rdtscp lm constant_tsc rep_good nopl cpuid extd_apicid pni "
    "pclmulqdq ssse3 fma cx16 sse4_1 sse4_2 x2apic movbe popcnt aes xsave avx f16c rdrand hypervisor lahf_lm "
    "cmp_legacy cr8_legacy abm sse4a misalignsse 3dnowprefetch topoext ssbd ibrs ibpb stibp vmmcall fsgsbase "
    "bmi1 avx2 smep bmi2 rdseed adx smap clflushopt clwb sha_ni xsaveopt xsavec xgetbv1 clzero xsaveerptr "
    "rdpru arat npt nrip_save umip rdpid"
)
SAPPHIRE_RAPIDS_FLAGS = (
    "flags\t\t: fpu sse sse2 avx fma f16c avx2 avx512f avx512dq avx512cd avx512bw avx512vl avx512_bf16 "
    "avx512_fp16 amx_bf16 amx_tile amx_int8 avx_vnni"
)
GRAVITON_FEATURES = "Features\t: fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics fphp asimdhp cpuid asimdrdm bf16"


def test_an_avx2_only_cpu_takes_the_avx2_kernels_and_no_onednn_bf16() -> None:
    features = parse_cpuinfo(f"processor\t: 0\n{AVX2_EPYC_FLAGS}\n", "x86_64")
    assert (features.avx2, features.fma, features.f16c, features.avx512f) == (True, True, True, False)
    assert features.kernel_isa == "avx2"
    assert features.supported_isas == ("generic", "avx2")
    assert not features.onednn_bf16 and not features.native_bf16
    assert linear_path(CPU, torch.bfloat16, features) == "bf16-weights"
    assert linear_path(CPU, torch.float32, features) == "onednn-packed"  # oneDNN's float32 kernels run anywhere on x86
    # No bf16 dot products: float32 is exact, and faster in batches.
    assert resolve_dtype("auto", tiny_config("LlamaForCausalLM", dtype="bfloat16"), CPU, features) == torch.float32


def test_amx_cpu_takes_the_avx512_bf16_kernels() -> None:
    features = parse_cpuinfo(SAPPHIRE_RAPIDS_FLAGS, "x86_64")
    assert features.amx_bf16 and features.amx_tile and features.native_bf16 and features.onednn_bf16
    assert features.kernel_isa == "avx512_bf16"
    assert features.supported_isas == ("generic", "avx2", "avx512", "avx512_bf16")
    assert resolve_dtype("auto", tiny_config("LlamaForCausalLM", dtype="bfloat16"), CPU, features) == torch.bfloat16
    assert (
        resolve_dtype("auto", tiny_config("LlamaForCausalLM", dtype="bfloat16"), torch.device("cuda"), features)
        == torch.bfloat16
    )


def test_a_gguf_file_runs_as_a_bf16_checkpoint_under_auto() -> None:
    """Its weights are blocks and its metadata names no dtype: bf16 where the CPU has bf16 dot
    products, float32 elsewhere; an explicit dtype wins."""
    no_dtype = tiny_config("LlamaForCausalLM")
    amx = parse_cpuinfo(SAPPHIRE_RAPIDS_FLAGS, "x86_64")
    assert resolve_dtype("auto", no_dtype, CPU, amx, gguf=True) == torch.bfloat16
    assert resolve_dtype("auto", no_dtype, CPU, amx) == torch.float32  # a folder naming no dtype: float32
    assert resolve_dtype("float32", no_dtype, CPU, amx, gguf=True) == torch.float32
    avx2 = parse_cpuinfo(AVX2_EPYC_FLAGS, "x86_64")
    assert resolve_dtype("auto", no_dtype, CPU, avx2, gguf=True) == torch.float32


def test_aarch64_takes_the_generic_build_and_float32_by_default() -> None:
    features = parse_cpuinfo(GRAVITON_FEATURES, "aarch64")
    assert features.neon and features.kernel_isa == "generic" and features.supported_isas == ("generic",)
    assert not features.onednn_bf16
    assert linear_path(CPU, torch.bfloat16, features) == "bf16-weights"
    assert linear_path(CPU, torch.float32, features) == "torch"
    assert resolve_dtype("auto", tiny_config("LlamaForCausalLM", dtype="bfloat16"), CPU, features) == torch.float32


def test_a_cap_removes_features_and_never_adds_them() -> None:
    features = parse_cpuinfo(SAPPHIRE_RAPIDS_FLAGS, "x86_64")
    assert cap_features(features, "avx512").kernel_isa == "avx512"
    capped = cap_features(features, "avx2")
    assert capped.kernel_isa == "avx2" and not capped.onednn_bf16 and not capped.amx_bf16
    assert cap_features(features, "generic").kernel_isa == "generic"
    avx2_only = parse_cpuinfo(AVX2_EPYC_FLAGS, "x86_64")
    assert cap_features(avx2_only, "avx512_bf16") == avx2_only
    with pytest.raises(ValueError, match="SPLITSERVE_CPU_ISA='sse9' is not a CPU ISA level"):
        cap_features(features, "sse9")


def test_detect_reads_this_cpu_and_honours_the_cap() -> None:
    here = detect()
    assert here.arch == os.uname().machine
    assert detect(cap="generic").kernel_isa == "generic"
    assert detect(cpuinfo=AVX2_EPYC_FLAGS, arch="x86_64").kernel_isa == "avx2"


def test_auto_dtype_keeps_float32_and_widens_float16_on_cpu() -> None:
    features = parse_cpuinfo(SAPPHIRE_RAPIDS_FLAGS, "x86_64")
    for configured, expected in [("float32", torch.float32), ("float16", torch.float32), ("bfloat16", torch.bfloat16)]:
        config = tiny_config("LlamaForCausalLM", dtype=configured)
        assert resolve_dtype("auto", config, CPU, features) == expected
        assert resolve_dtype("float16", config, CPU, features) == torch.float16  # explicit wins
    with pytest.raises(ValueError, match="dtype must be one of"):
        resolve_dtype("fp8", tiny_config("LlamaForCausalLM"), CPU, features)


@pytest.fixture
def capped_avx2(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv(CAP_ENV, "avx2")
    cpu_features.cache_clear()
    cpu_kernels.clear_cache()
    yield
    monkeypatch.delenv(CAP_ENV)
    cpu_features.cache_clear()
    cpu_kernels.clear_cache()


@pytest.mark.skipif(cpu_features().kernel_isa in ("generic", "avx2"), reason="this CPU already is at most AVX2")
def test_the_cap_switches_this_cpu_to_the_avx2_paths(capped_avx2: None) -> None:
    assert cpu_features().kernel_isa == "avx2"
    assert linear_path(CPU, torch.bfloat16) == "bf16-weights"
    kernels = cpu_kernels.load()
    assert kernels is None or kernels.isa == "avx2"


def bf16_reference(x: torch.Tensor, linear: nn.Linear) -> torch.Tensor:
    """float32 products of the bf16 values, rounded to bf16 once."""
    bias = None if linear.bias is None else linear.bias.float()
    return F.linear(x.float(), linear.weight.float(), bias).to(torch.bfloat16)


KERNEL_CHOICES = [None, *cpu_features().supported_isas]


@pytest.mark.parametrize("isa", KERNEL_CHOICES, ids=lambda isa: isa or "no-kernels")
@pytest.mark.parametrize("num_rows", [1, 2, 3, 5, 8, 9, 40, 65])
@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
def test_bf16_weight_linear_rounds_like_a_bf16_matmul(
    monkeypatch: pytest.MonkeyPatch, isa: str | None, num_rows: int, bias: bool
) -> None:
    # A small upcast slice, so that the sliced float32 path takes several slices.
    monkeypatch.setattr(cpu_linear, "_UPCAST_SLICE_ELEMENTS", 7 * 100)
    kernels = None if isa is None else cpu_kernels.load(isa)
    if isa is not None and kernels is None:
        pytest.skip("no C compiler")
    generator = torch.Generator().manual_seed(num_rows)
    linear = nn.Linear(100, 37, bias=bias).to(torch.bfloat16)
    module = BF16WeightLinear(linear, kernels)
    # Kept in bf16 (half the bytes per token), once: in the kernels' panels when there are kernels.
    kept = [tensor for tensor in (module.weight, module.panels) if tensor is not None]
    assert [tensor.dtype for tensor in kept] == [torch.bfloat16]
    x = torch.randn(num_rows, 100, generator=generator).to(torch.bfloat16)
    # Summation order differs from the reference: within one bf16 rounding step.
    torch.testing.assert_close(module(x), bf16_reference(x, linear), atol=1e-2, rtol=8e-3)


def test_prepare_linears_replaces_every_linear_by_the_path_module() -> None:
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Sequential(nn.Linear(32, 8, bias=False))).to(torch.bfloat16)
    assert prepare_linears(model, "bf16-weights") == 2
    assert [type(m) for m in (model[0], model[2][0])] == [BF16WeightLinear, BF16WeightLinear]
    assert prepare_linears(model, "torch") == 0


PACKED_DTYPES = [dtype for dtype in (torch.float32, torch.bfloat16) if linear_path(CPU, dtype) == "onednn-packed"]


@pytest.mark.parametrize("dtype", PACKED_DTYPES, ids=str)
@pytest.mark.parametrize("num_rows", [1, 2, 3, 16, 40])
@pytest.mark.parametrize("with_kernels", [False, True], ids=["packed-only", "panel-kernel"])
def test_packed_linear_matches_a_plain_matmul(dtype: torch.dtype, num_rows: int, with_kernels: bool) -> None:
    """Decode steps go to the panel kernel when there is one; the rest to oneDNN."""
    kernels = cpu_kernels.load() if with_kernels else None
    if with_kernels and kernels is None:
        pytest.skip("no C compiler")
    linear = nn.Linear(96, 80).to(dtype)
    module = PackedLinear(linear, kernels)
    assert (module.panels is None) == (kernels is None)  # the panels are kept only for the kernel
    x = torch.randn(num_rows, 96).to(dtype)
    expected = F.linear(x.float(), linear.weight.float(), linear.bias.float())
    tolerance = 1e-5 if dtype == torch.float32 else 8e-3
    torch.testing.assert_close(module(x).float(), expected, atol=tolerance, rtol=tolerance)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("isa", [isa for isa in cpu_features().supported_isas if isa != "generic"])
def test_packed_linear_sends_only_decode_steps_to_the_kernel(dtype: torch.dtype, isa: str) -> None:
    """float32 up to 64 rows with AVX-512 and 16 with AVX2, bf16 up to 48 with AVX512_BF16's dot
    products (no AMX) and four without: where the panel kernel beats oneDNN's packed weights."""
    if dtype not in PACKED_DTYPES:
        pytest.skip(f"oneDNN packs no {dtype} weights on this CPU")
    kernels = cpu_kernels.load(isa)
    if kernels is None:
        pytest.skip("no C compiler")
    if dtype == torch.float32:
        max_kernel_rows = 16 if isa == "avx2" else 64
    else:
        max_kernel_rows = 48 if isa == "avx512_bf16" and not cpu_features().amx_bf16 else 4
    calls: list[int] = []

    class Counting:
        isa = kernels.isa
        pack_panels = kernels.pack_panels

        def linear(self, x: torch.Tensor, *args: object) -> torch.Tensor:
            calls.append(x.shape[0])
            return kernels.linear(x, *args)

    module = PackedLinear(nn.Linear(96, 80).to(dtype), Counting())  # type: ignore[arg-type]
    for num_rows in range(1, max_kernel_rows + 3):
        module(torch.randn(num_rows, 96).to(dtype))
    assert calls == list(range(1, max_kernel_rows + 1))


_GENERATE = """
import json, sys, torch
from engine import LLM, SamplingParams
llm = LLM(model=sys.argv[1], dtype=sys.argv[2], kv_cache_memory=1 << 22)
qkv = llm.engine.runner.model.layers[0].qkv_proj
out = llm.generate([[5, 6, 7, 8], [9, 10, 11]], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
print(json.dumps({"dtype": str(llm.engine.runner.dtype), "linear": type(qkv).__name__,
                  "tokens": [o.outputs[0].token_ids for o in out]}))
"""
# What an AVX2-only CPU looks like to torch (oneDNN refuses bf16) and to splitserve.
AVX2_ONLY = {"ONEDNN_MAX_CPU_ISA": "AVX2", CAP_ENV: "avx2"}


def generate_in_subprocess(checkpoint: Path, dtype: str, env: dict[str, str]) -> dict[str, object]:
    result = subprocess.run(
        [sys.executable, "-c", _GENERATE, str(checkpoint), dtype],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=240,
        cwd=Path(__file__).parents[2],
    )
    if result.returncode != 0:
        raise AssertionError(f"generation failed:\n{result.stderr[-3000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


needs_avx2 = pytest.mark.skipif(
    cpu_features().arch != "x86_64" or cpu_features().kernel_isa == "generic", reason="needs AVX2"
)


@needs_avx2
def test_bf16_runs_where_onednn_has_no_bf16_path(tmp_path: Path) -> None:
    """Issue 11: on an AVX2-only CPU bf16 died packing weights. oneDNN capped at AVX2 refuses
    bf16 exactly as it does there; the engine must keep bf16 weights instead, and generate
    what the same engine does on the full CPU."""
    checkpoint = make_checkpoint(tmp_path / "bf16", dtype=torch.bfloat16)
    capped = generate_in_subprocess(checkpoint, "bfloat16", AVX2_ONLY)
    assert capped["dtype"] == "torch.bfloat16" and capped["linear"] == "BF16WeightLinear"
    full = generate_in_subprocess(checkpoint, "bfloat16", {})
    assert full["dtype"] == "torch.bfloat16"
    assert capped["tokens"] == full["tokens"]


@needs_avx2
def test_the_default_dtype_runs_on_an_avx2_only_cpu(tmp_path: Path) -> None:
    """``LLM()`` on a bf16 checkpoint (the README's example) picks float32 there."""
    checkpoint = make_checkpoint(tmp_path / "bf16", dtype=torch.bfloat16)
    capped = generate_in_subprocess(checkpoint, "auto", AVX2_ONLY)
    assert capped["dtype"] == "torch.float32" and capped["linear"] == "PackedLinear"
    assert len(capped["tokens"]) == 2 and all(len(tokens) == 4 for tokens in capped["tokens"])


def test_the_engine_logs_the_paths_it_chose(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    from engine import LLM

    checkpoint = make_checkpoint(tmp_path / "bf16", dtype=torch.bfloat16)
    with caplog.at_level(logging.INFO, logger="engine.models.loader"):
        LLM(model=str(checkpoint), dtype="bfloat16", kv_cache_memory=1 << 22)
    lines = [r.getMessage() for r in caplog.records if "linear path" in r.getMessage()]
    features = cpu_features()
    assert len(lines) == 1 and lines[0].startswith(f"CPU {features.describe()}: ")
    assert f"linear path {linear_path(CPU, torch.bfloat16)}" in lines[0]
    kernels = cpu_kernels.load()
    assert f"kernel ISA {kernels.isa if kernels else 'none (pure PyTorch)'}" in lines[0]
