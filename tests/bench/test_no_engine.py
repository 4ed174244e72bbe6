"""The client benchmarks (``bench/``) measure a server from outside: they start processes and
talk HTTP or gRPC, so they never load the engine, a connector, an instance or torch into their
own process (they run where torch is absent, and never time themselves against the server
they measure). The in-process benchmarks that load them live in ``microbench/``."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"
FORBIDDEN = ("engine", "kv_connector", "serving", "prefill_svc", "decode_svc", "colocated_svc", "microbench", "torch")
MODULES = sorted(path.stem for path in BENCH.glob("*.py") if path.stem != "__init__")


def forbidden_imports(source: str) -> list[str]:
    """Every import statement of ``source`` naming a forbidden package, at module level or
    inside a function (an import deferred to a call still loads it)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module is not None:
            names = [node.module]
        else:
            continue
        found += [f"line {node.lineno}: {name}" for name in names if name.split(".")[0] in FORBIDDEN]
    return found


def test_the_check_sees_imports_anywhere_in_a_module() -> None:
    source = "import os\nimport torch.nn\ndef f():\n    from engine.default_model import default_model_path\n"
    assert forbidden_imports(source) == ["line 2: torch.nn", "line 4: engine.default_model"]
    assert forbidden_imports("from bench.client import ENDPOINTS\nimport microbenchmark\n") == []


@pytest.mark.parametrize("module", MODULES)
def test_no_bench_module_imports_the_engine(module: str) -> None:
    assert forbidden_imports((BENCH / f"{module}.py").read_text()) == []


def test_importing_every_bench_module_loads_none_of_them() -> None:
    # In a fresh interpreter: what the modules import through others (launcher/, splitserve/) counts too.
    code = (
        "import importlib, sys; "
        f"[importlib.import_module('bench.' + name) for name in {MODULES!r}]; "
        f"loaded = sorted(m for m in sys.modules if m.split('.')[0] in {FORBIDDEN!r}); "
        "assert not loaded, loaded"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
