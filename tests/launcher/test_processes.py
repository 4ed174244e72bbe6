"""Every child command line comes from ``splitserve_command``: this tree's ``splitserve``, or
another checkout's code for a benchmark's "before" (trees from before and after the
``splitserve`` package), run from that checkout rather than this one's install."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from launcher.processes import Child, parse_instance_cpu_lists, splitserve_command

# What the fake trees' entry points print: the file that ran, its first stub's origin, its argv.
_REPORT = "import sys, os; print(__file__); print(os.getcwd()); print(WHERE); print(sys.argv[1:])\n"


def _write(path: Path, text: str = "") -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def _run(argv: list[str]) -> list[str]:
    result = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    return result.stdout.splitlines()


def test_this_tree_runs_the_splitserve_package_with_this_interpreter() -> None:
    command = splitserve_command("bench", "--help")
    assert command == [sys.executable, "-m", "splitserve", "bench", "--help"]
    assert "serve" in "\n".join(_run(command))


def test_a_tree_with_the_splitserve_package_runs_its_own(tmp_path: Path) -> None:
    _write(tmp_path / "splitserve" / "__init__.py")
    _write(tmp_path / "splitserve" / "cli.py")
    _write(tmp_path / "splitserve" / "v1" / "__init__.py", "WHERE = 'its stubs'\n")
    _write(tmp_path / "splitserve" / "__main__.py", "from splitserve.v1 import WHERE\n" + _REPORT)
    ran, cwd, stubs, argv = _run(splitserve_command("up", "--port", "1", source_dir=tmp_path))
    assert (Path(ran), Path(cwd), stubs, argv) == (
        tmp_path / "splitserve" / "__main__.py",
        tmp_path,
        "its stubs",
        "['up', '--port', '1']",
    )


def test_a_tree_from_before_the_package_runs_engine_cli_with_its_proto_stubs(tmp_path: Path) -> None:
    _write(tmp_path / "engine" / "__init__.py")
    _write(tmp_path / "engine" / "cli.py", "from splitserve.v1 import WHERE\n" + _REPORT)
    _write(tmp_path / "proto" / "splitserve" / "__init__.py")
    _write(tmp_path / "proto" / "splitserve" / "v1" / "__init__.py", "WHERE = 'its proto stubs'\n")
    command = splitserve_command("up", source_dir=tmp_path)
    assert command[-3:] == ["-m", "engine.cli", "up"]
    ran, cwd, stubs, argv = _run(command)
    assert (Path(ran), Path(cwd), stubs, argv) == (
        tmp_path / "engine" / "cli.py",
        tmp_path,
        "its proto stubs",
        "['up']",
    )


def test_one_cpu_list_is_shared_and_one_per_instance_is_each_its_own() -> None:
    assert parse_instance_cpu_lists("0", 3) == [{0}, {0}, {0}]
    assert parse_instance_cpu_lists("0|0", 2) == [{0}, {0}]
    with pytest.raises(ValueError, match="2 lists for 3 instances"):
        parse_instance_cpu_lists("0|0", 3)
    with pytest.raises(ValueError, match="bad CPU list"):
        parse_instance_cpu_lists("0|x", 2)


def test_a_pinned_child_runs_on_its_cpus_with_as_many_openmp_threads(tmp_path: Path) -> None:
    report = tmp_path / "report"
    seen = "repr((sorted(os.sched_getaffinity(0)), os.environ['OMP_NUM_THREADS']))"
    probe = f"import os; open({str(report)!r}, 'w').write({seen})"
    child = Child("probe", [sys.executable, "-c", probe], cpus={0})
    child.process.wait(timeout=60)
    assert report.read_text() == "([0], '1')"
