"""``python -m bench.gpu_check``: the GPU session check under the name the team runs it by.

The check loads the engine, which nothing in ``bench/`` imports; it lives in
:mod:`microbench.gpu_check`. This entry replaces its own process with
``python -m microbench.gpu_check`` and the same arguments (``os.execv``, not a child): a
signal sent to the command (``timeout`` on a lent machine) reaches the check itself, and the
check's exit status is the command's.
"""

from __future__ import annotations

import os
import sys
from typing import NoReturn


def main(argv: list[str] | None = None) -> NoReturn:
    argv = sys.argv[1:] if argv is None else argv
    os.execv(sys.executable, [sys.executable, "-m", "microbench.gpu_check", *argv])


if __name__ == "__main__":
    main()
