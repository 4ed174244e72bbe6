"""``python -m bench.overload`` hands splitserve's settings to the ``splitserve up`` it starts."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from bench import overload


@pytest.mark.parametrize("server", ["pd", "colocated"])
def test_quant_activations_reach_the_served_cluster(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, server: str
) -> None:
    started: list[tuple[str, list[str]]] = []

    def start_up(port: int, dtype: str, flags: list[str], log: Any, **kwargs: Any) -> None:
        started.append((dtype, flags))

    monkeypatch.setattr(overload, "start_up", start_up)
    base = ["--output-dir", str(tmp_path), "--server", server, "--dtype", "bfloat16"]
    overload.start_server(overload.parse_args([*base, "--quant-activations", "q8"]), 1, tmp_path / "a.log")
    overload.start_server(overload.parse_args(base), 1, tmp_path / "b.log")
    (dtype, with_q8), (_, default) = started
    assert dtype == "bfloat16"
    assert with_q8[with_q8.index("--quant-activations") + 1] == "q8"
    assert "--quant-activations" not in default  # the server's own default
