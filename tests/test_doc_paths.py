"""The current docs name only what exists: every repository path in README.md,
docs/architecture.md, docs/security.md and docs/observability.md (in prose, code or links), every relative link and
its anchor, and every ``python -m`` of a first-party module; and every pointer from the code
to a section of docs/benchmarks.md (``docs/benchmarks.md, "Section title"``) names one.
docs/benchmarks.md itself is a history and keeps the paths of its time."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [
    "README.md",
    "docs/architecture.md",
    "docs/security.md",
    "docs/observability.md",
    "docs/serving.md",
    "docs/api.md",
    "docs/library.md",
    "docs/deployment.md",
    "docs/benchmarking.md",
    "docs/simulator.md",
    "docs/planner.md",
]
BENCHMARKS = ROOT / "docs" / "benchmarks.md"
TOP_LEVEL = {path.name for path in ROOT.iterdir() if not path.name.startswith(".")}
FILE_SUFFIXES = {".py", ".md", ".c", ".h", ".proto", ".yml", ".yaml", ".toml", ".sh", ".json", ".html", ".png"}

_URL = re.compile(r"[a-z]+://\S+")
_LINK = re.compile(r"\]\(([^)\s]+)\)")
# a/b/c: not inside a longer path, a URL, an email or a dotted name.
_PATH = re.compile(r"(?<![\w/.:@~$-])[A-Za-z_][\w.-]*(?:/[\w.-]+)+/?")
_FOLDER = re.compile(r"`([A-Za-z_][\w-]*)/`")  # `engine/`, as the layout tables name folders
_RUN_MODULE = re.compile(r"python3? -m ([A-Za-z_][\w.]*)")
_HEADING = re.compile(r"^#+\s+(.+?)\s*$", re.MULTILINE)
_RUN_IN_HEADING = re.compile(r"\*\*([^*]+)\*\*")  # a paragraph's bold opening, "**A smaller step budget**"
# A pointer may wrap: the comment markers of the next line are dropped before matching.
_LINE_BREAK = re.compile(r"\s*\n\s*(?:#|\*|//)?\s*")
_POINTER = re.compile(r'docs/benchmarks\.md,\s*"([^"]+)"')


def git_ignored_paths() -> set[str]:
    """Exact paths .gitignore lists: files a reader makes (a secret) and never commits."""
    lines = (ROOT / ".gitignore").read_text().splitlines()
    return {line.strip() for line in lines if line.strip() and not line.startswith("#") and "*" not in line}


def anchors(markdown: str) -> set[str]:
    """The anchors GitHub gives the headings of ``markdown``."""
    return {re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-") for heading in _HEADING.findall(markdown)}


def missing_references(doc: Path, text: str) -> list[str]:
    """``line: reference`` for each reference in ``text`` (the contents of ``doc``) to
    something the repository lacks."""
    ignored = git_ignored_paths()
    missing = []
    for number, line in enumerate(text.splitlines(), 1):
        for target in _LINK.findall(line):
            if _URL.match(target) or target.startswith("mailto:"):
                continue
            path, _, anchor = target.partition("#")
            resolved = (doc.parent / path).resolve() if path else doc.resolve()
            if not resolved.is_relative_to(ROOT) or not resolved.exists():
                missing.append(f"{number}: link {target}")
            elif anchor and resolved.suffix == ".md":
                linked = text if resolved == doc.resolve() else resolved.read_text()
                if anchor not in anchors(linked):
                    missing.append(f"{number}: anchor {target}")
        line = _URL.sub("", _LINK.sub("", line))
        for path in _PATH.findall(line):
            path = path.rstrip(".")
            in_repository = path.split("/")[0] in TOP_LEVEL or Path(path.rstrip("/")).suffix in FILE_SUFFIXES
            if in_repository and path not in ignored and not (ROOT / path).exists():
                missing.append(f"{number}: {path}")
        for folder in _FOLDER.findall(line):
            if not (ROOT / folder).is_dir():
                missing.append(f"{number}: {folder}/")
        for module in _RUN_MODULE.findall(line):
            top = module.split(".")[0]
            if top in TOP_LEVEL:
                module_path = ROOT.joinpath(*module.split("."))
                if not (module_path.with_suffix(".py").is_file() or (module_path / "__main__.py").is_file()):
                    missing.append(f"{number}: python -m {module}")
    return missing


def benchmark_section_titles(markdown: str) -> list[str]:
    """Headings and bold paragraph openings, whitespace collapsed: what a pointer may name."""
    titles = _HEADING.findall(markdown) + _RUN_IN_HEADING.findall(markdown)
    return [" ".join(title.split()) for title in titles]


def dangling_pointers(text: str, titles: list[str]) -> list[str]:
    """The section titles ``text`` points at in docs/benchmarks.md that start no title there
    (a pointer may leave off a title's tail, such as "(issue #11)")."""
    pointed = {" ".join(title.split()) for title in _POINTER.findall(_LINE_BREAK.sub(" ", text))}
    return sorted(title for title in pointed if not any(candidate.startswith(title) for candidate in titles))


def test_stale_references_of_every_kind_are_found() -> None:
    text = "\n".join(
        [
            "see `engine/no_such_module.py` and engine/scheduler.py, [a](../../outside.md), [b](missing.md)",
            "[ok](security.md#the-cluster-secret) [gone](security.md#no-such-part) [here](#parts) [no](#nothing)",
            "https://example.com/a/b.py",
            "`nowhere/` `engine/` tokens/s P/D",
            "python -m bench.no_such_benchmark; python -m splitserve; python -m pytest",
            "`compose/cluster-secret` is made by the reader",
            "## Parts",
        ]
    )
    assert missing_references(ROOT / "docs" / "architecture.md", text) == [
        "1: link ../../outside.md",
        "1: link missing.md",
        "1: engine/no_such_module.py",
        "2: anchor security.md#no-such-part",
        "2: anchor #nothing",
        "4: nowhere/",
        "5: python -m bench.no_such_benchmark",
    ]


def test_pointers_may_wrap_and_leave_off_a_title_tail() -> None:
    titles = benchmark_section_titles("# Top\n## KV transfer (issue #3)\n\n**A smaller step budget** (...)\n")
    code = (
        '# measured (docs/benchmarks.md, "KV\n    # transfer"), and (docs/benchmarks.md, "A smaller\n * step budget")'
    )
    assert dangling_pointers(code, titles) == []
    assert dangling_pointers('docs/benchmarks.md, "KV transfers"', titles) == ["KV transfers"]


@pytest.mark.parametrize("name", DOCS)
def test_the_docs_name_only_what_exists(name: str) -> None:
    doc = ROOT / name
    assert missing_references(doc, doc.read_text()) == []


def test_the_benchmarks_links_resolve() -> None:
    """Only its links: the history's paths are those of its time."""
    missing = missing_references(BENCHMARKS, BENCHMARKS.read_text())
    assert [entry for entry in missing if ": link " in entry or ": anchor " in entry] == []


def test_the_code_points_at_benchmark_sections_that_exist() -> None:
    titles = benchmark_section_titles(BENCHMARKS.read_text())
    sources = [
        path
        for folder in ROOT.iterdir()
        if folder.is_dir() and not folder.name.startswith(".")
        for path in folder.rglob("*")
        if path.suffix in (".py", ".c", ".h") and path != Path(__file__)
    ]
    dangling = {
        str(path.relative_to(ROOT)): found
        for path in sorted(sources)
        if (found := dangling_pointers(path.read_text(), titles))
    }
    assert dangling == {}
