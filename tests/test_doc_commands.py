"""Every ``splitserve`` command in README.md and the docs pages (docs/benchmarks.md, a
history, aside) parses with the command's real flags: a renamed or removed flag fails here,
not in a reader's terminal. Commands are read from fenced code blocks, continuation lines
joined; the command is parsed, never run."""

from __future__ import annotations

import re
import shlex

import pytest

from splitserve.cli import build_parser
from tests.test_doc_paths import DOCS, ROOT

_FENCE = re.compile(r"^```[a-z]*\n(.*?)^```", re.MULTILINE | re.DOTALL)


def doc_commands(markdown: str) -> list[str]:
    """The ``splitserve ...`` command lines of ``markdown``'s code blocks, continuations joined,
    comments and shell redirections or pipes after the command dropped."""
    commands = []
    for block in _FENCE.findall(markdown):
        for line in block.replace("\\\n", " ").splitlines():
            for part in line.split("  #")[0].split("&&"):
                part = part.strip()
                if part.startswith("splitserve "):
                    commands.append(re.split(r"\s(?:>|\|)\s", part)[0])
    return commands


def parse_error(command: str) -> str | None:
    """None when the command parses; else what argparse said."""
    argv = shlex.split(command)[1:]
    parser, _ = build_parser(argv)
    try:
        parser.parse_args(argv)
    except SystemExit as error:
        return f"exit {error.code}"
    return None


@pytest.mark.parametrize("name", DOCS)
def test_every_splitserve_command_in_the_docs_parses(name: str, capsys: pytest.CaptureFixture[str]) -> None:
    commands = doc_commands((ROOT / name).read_text())
    failures = [(command, error, capsys.readouterr().err) for command in commands if (error := parse_error(command))]
    assert not failures, failures


def test_a_command_with_a_flag_that_does_not_exist_fails(capsys: pytest.CaptureFixture[str]) -> None:
    markdown = "```bash\nsplitserve up --num-prefill 2 \\\n    --no-such-flag 3\n```\n"
    (command,) = doc_commands(markdown)
    assert parse_error(command) == "exit 2"
    assert "--no-such-flag" in capsys.readouterr().err


def test_the_readme_shows_its_commands() -> None:
    commands = doc_commands((ROOT / "README.md").read_text())
    assert any(command.startswith("splitserve up") for command in commands)
    assert any(command.startswith("splitserve bench serve") for command in commands)
