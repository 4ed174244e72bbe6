"""The planner's flags, declared once: ``splitserve planner`` takes them, and ``splitserve up
--simulate --planner`` passes them on (:func:`planner_argv`)."""

from __future__ import annotations

import argparse

from planner.actuator import DECODE_DRAINS
from planner.capacity import Slo
from planner.decision import ROLES, PlannerBounds, RoleBounds
from planner.predictors import PREDICTORS

Flag = tuple[str, type, object, str]  # (flag, type, default, help)

# The SLOs, which ``splitserve profile`` measures capacity at as well (planner/profile_cli.py).
SLO_FLAGS: tuple[Flag, ...] = (
    ("--ttft-slo", float, 1.0, "the TTFT p90 to hold, seconds"),
    ("--itl-slo", float, 0.05, "the ITL p90 to hold, seconds"),
)
ROLE_BOUNDS = {"min": ("at least", 1), "max": ("at most", 8)}  # per role: --min-ROLE, --max-ROLE

_FLAGS: tuple[Flag, ...] = (
    *SLO_FLAGS,
    *(
        (f"--{bound}-{role}", int, default, f"{role} instances {words}")
        for role in ROLES
        for bound, (words, default) in ROLE_BOUNDS.items()
    ),
    ("--max-instances", int, 16, "instances of both roles together at most (the budget)"),
    ("--plan-interval", float, 5.0, "seconds between decisions"),
    ("--up-cooldown", float, 10.0, "seconds after a role's pool changed before it grows again"),
    ("--down-cooldown", float, 60.0, "seconds after a role's pool changed before it shrinks"),
    ("--down-margin", float, 0.2, "shrink a pool only to what this much more than the predicted rate needs"),
    ("--plan-prompt-tokens", float, 512.0, "mean prompt tokens assumed before traffic shows its own"),
    ("--plan-output-tokens", float, 128.0, "mean output tokens assumed before traffic shows its own"),
)


def add_flags(parser: argparse.ArgumentParser, flags: tuple[Flag, ...]) -> None:
    for flag, kind, default, help_text in flags:
        parser.add_argument(flag, type=kind, default=default, help=f"{help_text} (default {default})")


def add_decode_drain_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--decode-drain",
        choices=list(DECODE_DRAINS),
        default="hand-over",
        help="how a decode instance the planner scales down drains: hand-over (SIGUSR2: it hands its streams "
        "back to their gateways, which resume them on another decode instance, so it stops within a step or "
        "two), or wait (SIGUSR1: it finishes every stream it holds first) (default hand-over)",
    )


def add_planner_arguments(parser: argparse.ArgumentParser) -> None:
    add_flags(parser, _FLAGS)
    parser.add_argument(
        "--predictor",
        choices=list(PREDICTORS),
        default="moving-average",
        help="the load predictor: the one that predicted the benchmark's day best at 5 s intervals (docs/planner.md)",
    )
    add_decode_drain_argument(parser)


def planner_argv(args: argparse.Namespace) -> list[str]:
    """The flags above as ``args`` holds them, for a child ``splitserve planner``."""
    argv: list[str] = []
    for flag, _, _, _ in _FLAGS:
        argv += [flag, str(getattr(args, flag.lstrip("-").replace("-", "_")))]
    return argv + ["--predictor", args.predictor, "--decode-drain", args.decode_drain]


def slo_of(args: argparse.Namespace) -> Slo:
    return Slo(args.ttft_slo, args.itl_slo)


def bounds_of(args: argparse.Namespace) -> PlannerBounds:
    prefill, decode = (RoleBounds(getattr(args, f"min_{role}"), getattr(args, f"max_{role}")) for role in ROLES)
    return PlannerBounds(
        prefill,
        decode,
        args.max_instances,
        up_cooldown_s=args.up_cooldown,
        down_cooldown_s=args.down_cooldown,
        down_margin=args.down_margin,
    )
