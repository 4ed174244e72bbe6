"""``python -m bench.gpu_check``, the name the team runs the GPU session check by, is
``microbench.gpu_check`` itself: the same arguments reach it and its exit status is the
command's. (The check's own test: tests/microbench/test_gpu_check.py.)"""

from __future__ import annotations

import subprocess
import sys


def run(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "bench.gpu_check", *argv], capture_output=True, text=True, timeout=120)


def test_the_arguments_reach_the_check() -> None:
    result = run("--help")
    assert result.returncode == 0, result.stderr[-2000:]
    assert "--skip-throughput" in result.stdout


def test_the_command_exits_with_the_check_status() -> None:
    result = run("--skip-parity", "--no-such-flag")
    assert result.returncode == 2
    assert "unrecognized arguments: --no-such-flag" in result.stderr
