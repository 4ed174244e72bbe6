"""The engine is a library: no module of it imports a part built on it (the product's
command, the instances, the cluster plane, the services, the gateway, the launcher, the
benchmarks), at module level or deferred inside a function, so it installs, imports and
tests alone."""

from __future__ import annotations

import ast
from pathlib import Path

ENGINE = Path(__file__).resolve().parents[2] / "engine"
ABOVE = (
    "splitserve",
    "engine_args",
    "serving",
    "cluster",
    "prefill_svc",
    "decode_svc",
    "colocated_svc",
    "gateway",
    "launcher",
    "bench",
    "microbench",
    "kv_connector",
)


def imports_above(source: str) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module is not None:
            names = [node.module]
        else:
            continue
        found += [f"line {node.lineno}: {name}" for name in names if name.split(".")[0] in ABOVE]
    return found


def test_the_check_sees_deferred_imports() -> None:
    assert imports_above("import torch\ndef f():\n    from engine_args.flags import DTYPES\n") == [
        "line 3: engine_args.flags"
    ]


def test_no_engine_module_imports_a_part_above_it() -> None:
    modules = sorted(ENGINE.rglob("*.py"))
    assert ENGINE / "llm.py" in modules
    found = {str(path.relative_to(ENGINE)): imports_above(path.read_text()) for path in modules}
    assert {path: names for path, names in found.items() if names} == {}
