"""The gateway never imports torch (docs/architecture.md, "Parts"): it must start fast and run
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


def test_gateway_modules_do_not_import_the_instances_or_the_kv_connector() -> None:
    # The gateway reaches instances over gRPC only: a helper it needs from them lives in cluster/.
    code = (
        "import importlib, pkgutil, sys, cluster, gateway; "
        "names = [m.name for p in (gateway, cluster) for m in pkgutil.iter_modules(p.__path__, p.__name__ + '.')]; "
        "[importlib.import_module(name) for name in names]; "
        "parts = ('kv_connector', 'serving', 'prefill_svc', 'decode_svc', 'colocated_svc'); "
        "loaded = sorted(m for m in sys.modules if m.split('.')[0] in parts); "
        "assert not loaded, loaded"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
