"""The verify-attention microbench times every build it is given, at every context and row count."""

from __future__ import annotations

import pytest

from engine import cpu_kernels
from microbench import verify_attention

pytestmark = pytest.mark.skipif(cpu_kernels.load() is None, reason="no C compiler: no native kernels to time")


def test_it_reports_every_context_and_row_count_against_the_first_build(capsys: pytest.CaptureFixture[str]) -> None:
    library = cpu_kernels.load()._library._name  # type: ignore[union-attr]
    args = ["--library", "this", "--library", library, "--contexts", "20,40", "--rows", "1,3", "--repeats", "1"]
    assert verify_attention.main(args) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("context")]
    assert len(lines) == 4
    for line in lines:
        cells = line.split(": ", 1)[1].split("  ")
        assert [cell.split()[0] for cell in cells] == ["this", library.rsplit("/", 1)[-1]]
        assert all(float(cell.split()[1]) > 0 for cell in cells), line
