"""``python -m launcher.embedded_model [--load-format F] [--dtype D] [--device X]``: the child
process ``splitserve up`` runs before starting anything (``launcher.processes.embedded_model``).
It prints the embedded model's path in the form engine/default_model.py chooses for those flags
(converting the folder first if it is that and not done yet), then on a second line the name it
is served under. The choice and the conversion load torch and the engine, so they run here,
once, and never in the launcher: this module imports the engine only inside :func:`main`.

The flags are the engine's own declarations (engine_args/flags.py), so they mean here what they
mean to the instances the launcher then starts."""

from __future__ import annotations

import argparse
import logging
import sys

from engine_args.flags import add_device_argument, add_dtype_argument, add_load_format_argument


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m launcher.embedded_model", description=__doc__.splitlines()[0])
    add_load_format_argument(parser)
    add_dtype_argument(parser)
    add_device_argument(parser)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from engine.default_model import DEFAULT_MODEL_NAME, embedded_model

    try:
        path = embedded_model(args.load_format, args.dtype, args.device)
    except ValueError as error:
        sys.stderr.write(f"{error}\n")
        return 2
    sys.stdout.write(f"{path}\n{DEFAULT_MODEL_NAME}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
