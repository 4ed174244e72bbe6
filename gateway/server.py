"""``splitserve gateway``: the OpenAI-compatible REST front and the gRPC
``Generation`` front, routing each request to a prefill and a decode instance."""

from __future__ import annotations

import argparse
import os

DEFAULT_PORT = 8000
DEFAULT_GRPC_PORT = 50051


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="local Hugging Face folder whose tokenizer the gateway uses (default: embedded SmolLM2-135M-Instruct)")
    parser.add_argument("--served-model-name", default=None, help="model name clients send and /v1/models lists (default: the folder's name)")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind the REST and gRPC fronts to")
    parser.add_argument("--port", type=int, default=DEFAULT_PORT, help="REST port")
    parser.add_argument("--grpc-port", type=int, default=DEFAULT_GRPC_PORT, help="gRPC Generation port (0: any free port, -1: off)")
    parser.add_argument("--api-key", default=os.environ.get("SPLITSERVE_API_KEY") or None, help="require 'Authorization: Bearer KEY' (env SPLITSERVE_API_KEY)")
    parser.add_argument("--prefill", action="append", default=[], metavar="HOST:PORT", help="a prefill instance (repeatable); static routing")
    parser.add_argument("--decode", action="append", default=[], metavar="HOST:PORT", help="a decode instance (repeatable); static routing")
    parser.add_argument("--colocated", action="append", default=[], metavar="HOST:PORT", help="an instance doing both phases (repeatable)")
    parser.add_argument("--registry-url", default=os.environ.get("SPLITSERVE_REGISTRY_URL", ""), help="redis://HOST:PORT where instances register (instead of static lists)")
    parser.add_argument("--poll-interval", type=float, default=0.5, help="seconds between load polls of each instance")
    parser.add_argument("--stale-after", type=float, default=3.0, help="seconds without a fresh load report before an instance is skipped")
    parser.add_argument("--max-pending-requests", type=int, default=1024, help="requests in flight at once; beyond this the gateway answers 429")
    parser.add_argument("--max-model-len", type=int, default=None, help="refuse longer requests (default: what the instances report)")
    parser.add_argument("--request-timeout", type=float, default=600.0, help="seconds a request may take end to end")


def run(args: argparse.Namespace) -> int:
    raise NotImplementedError("gateway: under construction")
