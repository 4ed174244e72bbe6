"""``python -m splitserve``: the ``splitserve`` command."""

import sys

from splitserve.cli import main

# Guarded: a tensor-parallel instance's worker processes start by "spawn", which imports the
# parent's main module again, and must not run the command a second time.
if __name__ == "__main__":
    sys.exit(main())
