"""``splitserve up``: start a gateway with its prefill and decode instances (or one
colocated instance) as local processes, wait until ready, stop all on Ctrl-C / SIGTERM."""

from __future__ import annotations

import argparse
import os


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="local Hugging Face folder (default: embedded SmolLM2-135M-Instruct)")
    parser.add_argument("--host", default="127.0.0.1", help="address the gateway binds to (instances stay on 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8000, help="REST port")
    parser.add_argument("--grpc-port", type=int, default=50051, help="gRPC Generation port")
    parser.add_argument("--api-key", default=os.environ.get("SPLITSERVE_API_KEY") or None)
    parser.add_argument("--kv-connector", default="ucx", choices=["ucx", "lmcache"])
    parser.add_argument("--num-prefill", type=int, default=1)
    parser.add_argument("--num-decode", type=int, default=1)
    parser.add_argument("--colocated", action="store_true", help="one instance doing both phases instead of prefill + decode")
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    parser.add_argument("--kv-cache-memory", type=int, default=None, help="KV cache bytes per instance on CPU")
    parser.add_argument("--prefill-cpus", default=None, help="CPU list for prefill instances, e.g. '0' or '0-3' (taskset)")
    parser.add_argument("--decode-cpus", default=None, help="CPU list for decode instances")


def run(args: argparse.Namespace) -> int:
    raise NotImplementedError("up: under construction")
