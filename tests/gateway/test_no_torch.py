"""The gateway never imports torch (ARCHITECTURE.md): it must start fast and run
on hosts without an accelerator stack."""

from __future__ import annotations

import subprocess
import sys


def test_gateway_modules_do_not_import_torch() -> None:
    code = (
        "import sys, gateway.server, gateway.app, gateway.grpc_front, serving.registration, launcher.up; "
        "loaded = [m for m in ('torch', 'triton') if m in sys.modules]; "
        "assert not loaded, loaded"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
