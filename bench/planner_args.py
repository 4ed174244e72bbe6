"""``python -m bench.planner``'s flags. The day's and the SLOs' defaults depend on what the
instances are: a GPU-profile day run 20 times slower for simulated instances, and a day sized
for real instances of the embedded model on a small CPU host (a few instances beside each
other, time scale 1), where the planner has at most three instances to share between the roles
and moves them as the mix turns from chatty (decode-bound) to long prompts (prefill-bound).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from engine_args.flags import add_dtype_argument
from planner.flags import add_decode_drain_argument
from planner.instance_commands import REAL_SHAPE_PROFILE
from planner.predictors import PREDICTORS
from simulator.timing_model import DEFAULT_PROFILE

MODES = ("static-peak", "static-mean", "planner")

# Flags whose default depends on --instances: the same day compressed for simulated GPU-like
# instances, or one a CPU host's real instances carry at their own speed.
DEFAULTS: dict[str, dict[str, Any]] = {
    "simulated": {
        "profile": DEFAULT_PROFILE,
        "time_scale": 20.0,
        "ttft_slo": 1.0,
        "itl_slo": 0.01,
        "peak_rate": 60.0,
        "trough_ratio": 0.1,
        "long_share": 0.7,
        "chatty": "128:256",
        "long": "2048:128",
        "duration_s": 1200.0,
        "window_s": 60.0,
        "max_per_role": 8,
        "max_instances": 12,
    },
    "real": {
        # The shape the planner prices SmolLM2 on a CPU with; its level comes from the
        # capacity profile measured on the run's own instances.
        "profile": REAL_SHAPE_PROFILE,
        "time_scale": 1.0,
        "ttft_slo": 4.0,
        "itl_slo": 0.06,
        # Long prompts every few seconds at noon make prefill the bound; the chatty night's long
        # streams make decode's ITL the bound: the planner moves its third instance between them.
        "peak_rate": 0.3,
        "trough_ratio": 0.5,
        "long_share": 0.9,
        "chatty": "32:512",
        "long": "768:16",
        "duration_s": 300.0,
        "window_s": 30.0,
        "max_per_role": 2,
        "max_instances": 3,
    },
}


def build_parser(description: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--output-dir", type=Path, required=True)
    parser.add_argument(
        "--instances",
        choices=["simulated", "real"],
        default="simulated",
        help="simulated: `splitserve simulate` processes of --profile; real: `splitserve prefill|decode` "
        "processes of --model (defaults below change with it)",
    )
    parser.add_argument(
        "--model",
        type=Path,
        default=None,
        help="real: the model's folder or .gguf file (default: the embedded SmolLM2 GGUF `splitserve up` serves)",
    )
    add_dtype_argument(parser, default="float32")  # real: the instances' --dtype
    parser.add_argument("--kv-blocks", type=int, default=512, help="real: each instance's KV blocks (--num-blocks)")
    parser.add_argument(
        "--capacity-profile",
        type=Path,
        default=None,
        metavar="FILE",
        help="real: what `splitserve profile` measured one instance of each role to sustain at these SLOs; "
        "without it the run measures one first on its own instances (capacity-profile.json in --output-dir)",
    )
    parser.add_argument("--profile-seconds-per-level", type=float, default=10.0, help="real: the profile's sweeps")
    parser.add_argument("--profile-min-requests", type=int, default=12, help="real: prefill requests a level sends")
    parser.add_argument("--profile-refine-steps", type=int, default=1, help="real: bisections of the prefill rate")
    parser.add_argument("--profile-max-levels", type=int, default=5, help="real: load levels per role at most")
    parser.add_argument("--profile", help="the instances' timing profile (simulated) or the shape pricing them (real)")
    parser.add_argument("--time-scale", type=float, help="simulated: everything that many times slower")
    parser.add_argument("--ttft-slo", type=float, help="seconds, in the profile's time")
    parser.add_argument("--itl-slo", type=float, help="seconds, in the profile's time")
    parser.add_argument("--peak-rate", type=float, help="requests a second at noon, profile time")
    parser.add_argument("--trough-ratio", type=float, help="the night's rate over the peak's")
    parser.add_argument("--long-share", type=float, help="long-prompt requests' share at noon")
    parser.add_argument("--chatty", help="a chatty request's mean prompt:output tokens")
    parser.add_argument("--long", help="a long-prompt request's mean prompt:output tokens")
    parser.add_argument("--duration-s", type=float, help="the compressed day, real seconds")
    parser.add_argument("--window-s", type=float, help="a window of the SLO attainment, real seconds")
    parser.add_argument("--modes", default=",".join(MODES), help="which ways, comma-separated")
    parser.add_argument("--plan-interval", type=float, default=5.0)
    parser.add_argument("--up-cooldown", type=float, default=5.0)
    parser.add_argument("--down-cooldown", type=float, default=30.0)
    parser.add_argument("--down-margin", type=float, default=0.2)
    parser.add_argument("--predictor", default="moving-average", choices=list(PREDICTORS))
    add_decode_drain_argument(parser)
    parser.add_argument("--max-per-role", type=int, help="the planner's bound per role, and the static pools' too")
    parser.add_argument("--max-instances", type=int, help="the planner's bound on both roles together")
    parser.add_argument("--seed", type=int, default=0)
    return parser


def parse(argv: list[str] | None, description: str) -> argparse.Namespace:
    parser = build_parser(description)
    args = parser.parse_args(argv)
    for name, default in DEFAULTS[args.instances].items():
        if getattr(args, name) is None:
            setattr(args, name, default)
    unknown = sorted(set(args.modes.split(",")) - set(MODES) - {""})
    if unknown:
        parser.error(f"--modes takes {', '.join(MODES)}; got {', '.join(unknown)}")
    if args.instances == "real" and args.time_scale != 1.0:
        parser.error("--instances real runs at the model's own speed: drop --time-scale (or give 1)")
    if args.instances == "simulated" and (args.model is not None or args.capacity_profile is not None):
        parser.error("--model and --capacity-profile are for --instances real")
    return args
