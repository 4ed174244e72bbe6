"""Regenerate the Python gRPC stubs from the .proto files.

    python proto/generate.py            # writes splitserve/v1/*_pb2*.py at the repository root
    python proto/generate.py --out DIR  # elsewhere (the staleness test compares)

The .proto files stay here, the contract; their stubs live in the product's package
(``splitserve.v1``, the .proto package name), never in a top-level ``proto`` package.

The stubs are committed, so users need no protoc. Generate them with
grpcio-tools 1.78.0, the version lmcache pins grpcio to.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from grpc_tools import protoc

PROTO_ROOT = Path(__file__).resolve().parent
REPO_ROOT = PROTO_ROOT.parent  # protoc writes <out>/splitserve/v1/
PROTO_FILES = sorted(PROTO_ROOT.glob("splitserve/v1/*.proto"))


def generate(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    include = Path(protoc.__file__).parent / "_proto"  # google/protobuf/*.proto
    args = [
        "protoc",
        f"-I{PROTO_ROOT}",
        f"-I{include}",
        f"--python_out={out}",
        f"--pyi_out={out}",
        f"--grpc_python_out={out}",
        *(str(path.relative_to(PROTO_ROOT)) for path in PROTO_FILES),
    ]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed: {' '.join(args)}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=REPO_ROOT)
    generate(parser.parse_args().out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
