"""microbench.throughput's vLLM leg end to end, with a stand-in ``vllm`` package: vLLM's CPU
build pins its own torch and cannot be installed beside this project, so the test checks
what this side owns (the request file, the child process, its result file, the token
check) and the stand-in answers as vLLM's ``LLM.generate`` does, logging to stdout until
it exits as vLLM does."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import pytest

from microbench.throughput import make_result, run_vllm

FAKE_VLLM = """
import atexit
from dataclasses import dataclass

print("INFO vllm: starting")  # vLLM logs to stdout, before the run and after it
atexit.register(print, "INFO vllm: [shutdown] Executor: all workers exited gracefully")

@dataclass
class SamplingParams:
    temperature: float
    max_tokens: int
    ignore_eos: bool

@dataclass
class _Completion:
    token_ids: list

@dataclass
class _Output:
    outputs: list

class LLM:
    def __init__(self, model, dtype, max_model_len, seed):
        assert dtype == "float32" and max_model_len == 12, (dtype, max_model_len)

    def generate(self, prompts, params, use_tqdm):
        return [_Output([_Completion(list(range(params.max_tokens)))]) for _ in prompts]
"""


def test_vllm_leg_runs_in_its_own_python_and_reports_the_timed_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    package = tmp_path / "vllm"
    (package / "inputs").mkdir(parents=True)
    (package / "__init__.py").write_text(FAKE_VLLM)
    (package / "inputs" / "__init__.py").write_text(
        "def TokensPrompt(prompt_token_ids):\n    return {'prompt_token_ids': prompt_token_ids}\n"
    )
    monkeypatch.setenv("PYTHONPATH", f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    args = argparse.Namespace(vllm_python=sys.executable, vllm_cpus="0", dtype="float32", input_len=8, output_len=4)
    prompts = [[5] * 8, [6] * 8, [7] * 8]
    elapsed_s, num_output_tokens = run_vllm(args, tmp_path / "model", prompts, warmup_prompts=[[9] * 8])
    assert elapsed_s > 0 and num_output_tokens == 12
    assert make_result("vllm", elapsed_s, prompts, num_output_tokens, 4).num_output_tokens == 12
