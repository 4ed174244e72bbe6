"""``python -m splitserve``: the ``splitserve`` command."""

import sys

from splitserve.cli import main

sys.exit(main())
