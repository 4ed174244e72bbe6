"""The gateway never imports torch (ARCHITECTURE.md): it must start fast and run
on hosts without an accelerator stack. Neither does ``cluster/``, what the gateway
shares with the instances."""

from __future__ import annotations

import subprocess
import sys


def test_gateway_modules_do_not_import_torch() -> None:
    # Every module of the gateway's packages, found on disk: a new one is checked too.
    code = (
        "import importlib, pkgutil, sys, cluster, gateway, launcher.up; "
        "names = [m.name for p in (gateway, cluster) for m in pkgutil.iter_modules(p.__path__, p.__name__ + '.')]; "
        "assert 'gateway.server' in names and 'cluster.registration' in names, names; "
        "[importlib.import_module(name) for name in names]; "
        "loaded = [m for m in ('torch', 'triton') if m in sys.modules]; "
        "assert not loaded, loaded"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
