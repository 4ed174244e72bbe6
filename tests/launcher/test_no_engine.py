"""``splitserve up`` starts processes: the launcher imports neither the engine nor torch (the
embedded model's folder comes from a child process, the engine's flags from engine_args/flags.py),
so it starts fast. tests/bench/test_no_engine.py holds the client benchmarks to the same,
tests/gateway/test_no_torch.py the gateway to no torch."""

from __future__ import annotations

import subprocess
import sys


def test_the_launcher_and_the_command_import_neither_engine_nor_torch() -> None:
    # Every module of the launcher, found on disk: a new one is checked too.
    code = (
        "import importlib, pkgutil, sys, launcher; "
        "names = [m.name for m in pkgutil.iter_modules(launcher.__path__, 'launcher.')]; "
        "names += ['splitserve.cli', 'engine_args.flags', 'engine_args.config']; "
        "assert 'launcher.up' in names, names; "
        "[importlib.import_module(name) for name in names]; "
        "loaded = sorted(m for m in sys.modules if m.split('.')[0] in ('engine', 'torch', 'triton')); "
        "assert not loaded, loaded"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
