"""The ``splitserve`` command. Each subcommand lives with the part it runs and is
imported only when invoked, so ``splitserve generate`` never loads grpc and the
gateway's subcommands never load torch."""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from types import ModuleType

# subcommand -> (module defining ``add_arguments(parser)`` and ``run(args)``, help)
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "generate": ("splitserve.generate", "generate text offline with the engine"),
    "perplexity": ("splitserve.perplexity", "measure a model's perplexity over a text, as llama-perplexity does"),
    "train-heads": ("splitserve.train_heads", "train Medusa heads for a model on its own generations, on this machine"),
    "prefill": ("prefill_svc.server", "serve the engine in the prefill role over gRPC"),
    "decode": ("decode_svc.server", "serve the engine in the decode role over gRPC"),
    "colocated": ("colocated_svc.server", "serve the engine doing both phases over gRPC (no KV hand-off)"),
    "gateway": ("gateway.server", "serve the OpenAI-compatible REST and gRPC fronts, routing to instances"),
    "up": ("launcher.up", "start a gateway with prefill and decode instances on this machine"),
    "simulate": ("simulator.cli", "serve simulated instances: the real internal API, a timing model for the model"),
    "planner": (
        "planner.cli",
        "size the prefill and decode pools to the TTFT and ITL SLOs, starting and stopping instances",
    ),
    "profile": (
        "planner.profile_cli",
        "measure what one prefill and one decode instance sustain within the SLOs, for the planner",
    ),
    "drain": (
        "planner.drain",
        "a pod's preStop hook: stop an instance taking requests and wait until it holds none",
    ),
    "bench": ("bench.cli", "benchmark an OpenAI-compatible server (serve, sweep, plot)"),
}


def build_parser(argv: list[str]) -> tuple[argparse.ArgumentParser, dict[str, ModuleType]]:
    """The command's parser for ``argv``, with the flags of the subcommand it names (imported
    only then; the rest listed by help text), and that subcommand's module by name."""
    parser = argparse.ArgumentParser(prog="splitserve", description="Disaggregated prefill/decode LLM serving.")
    parser.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    chosen = next((arg for arg in argv if arg in SUBCOMMANDS), None)
    modules = {}
    for name, (module_name, help_text) in SUBCOMMANDS.items():
        sub = subparsers.add_parser(name, help=help_text)
        if name == chosen:
            modules[name] = importlib.import_module(module_name)
            modules[name].add_arguments(sub)
    return parser, modules


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser, modules = build_parser(argv)
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return int(modules[args.command].run(args) or 0)
    except ValueError as error:
        parser.exit(2, f"splitserve {args.command}: error: {error}\n")


if __name__ == "__main__":
    sys.exit(main())
