"""The launcher's child that resolves the embedded model (launcher/embedded_model.py): what
``splitserve up`` reads from it, and its flags, which are the engine's own declarations."""

from __future__ import annotations

import subprocess
import sys

import pytest

from engine.default_model import DEFAULT_MODEL_NAME, find_gguf
from launcher import embedded_model


def test_the_launchers_child_prints_the_path_then_the_served_name() -> None:
    """What ``splitserve up`` reads (launcher/processes.py): the form asked for, the name kept."""
    command = [sys.executable, "-m", "launcher.embedded_model", "--load-format", "gguf", "--dtype", "float32"]
    lines = subprocess.run(command, check=True, stdout=subprocess.PIPE, text=True).stdout.splitlines()
    assert lines == [str(find_gguf()), DEFAULT_MODEL_NAME]


@pytest.mark.parametrize("flag", ["--dtype", "--load-format"])
def test_its_flags_refuse_what_the_instances_refuse(flag: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        embedded_model.main([flag, "float64"])
    assert exited.value.code == 2
    assert "invalid choice: 'float64'" in capsys.readouterr().err
