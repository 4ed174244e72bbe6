"""The GPU session script, as a small dry run on CPU (kernels under the Triton interpreter):
it must work the first time a GPU is lent, so every step runs here."""

from __future__ import annotations

import json
from pathlib import Path

from microbench import gpu_check


def test_dry_run_checks_kernels_parity_and_throughput(tmp_path: Path) -> None:
    output = tmp_path / "out" / "gpu_check.json"
    assert gpu_check.main(["--device", "cpu", "--output-json", str(output)]) == 0
    report = json.loads(output.read_text())
    assert report["device"] == "cpu (dry run)"
    kernels = report["kernels"]
    assert {case["dtype"] for case in kernels} == {"float32", "bfloat16"} and all(case["ok"] for case in kernels)
    assert report["parity"]["mismatches"] == [] and report["parity"]["prompts"] == 2
    assert report["throughput"]["splitserve"]["output_tokens_per_s"] > 0


def test_an_error_beyond_tolerance_or_a_store_difference_fails_the_check() -> None:
    """A kernel that strays into the cache's other layers (NaN) scores an infinite error."""
    case = gpu_check.KernelCase("float32", "9/3 x 64", "decodes", 1e-5, 1e-4, True, 1.0, 1.0)
    assert case.ok
    assert not gpu_check.KernelCase("float32", "9/3 x 64", "decodes", float("inf"), 1e-4, True, 1.0, 1.0).ok
    assert not gpu_check.KernelCase("float32", "9/3 x 64", "decodes", 1e-5, 1e-4, False, 1.0, 1.0).ok
