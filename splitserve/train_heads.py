"""``splitserve train-heads --method medusa|eagle|eagle3 --output DIR``: Medusa heads or an
EAGLE(-3) draft for a model, trained on this machine from the model's own greedy continuations
(engine/spec_decode/medusa_training.py, eagle_training.py, eagle3_training.py).

The prompts: ``--prompts-file`` (one prompt a line), or by default everyday questions shipped
with the package interleaved with instructions over the paragraphs of its text
(splitserve/data/README.md says which), sent through the model's chat template where it has one.
The heads land in ``DIR`` in vLLM's Medusa layout over the target's own LM head
(engine/spec_decode/medusa_checkpoint.py), with what they were trained on and their held-out
accuracy in ``DIR/config.json``; serve them with
``--speculative-config '{"method": "medusa", "model": "DIR"}'``. An interrupted run resumes
from ``DIR/work`` (generated shards, the last training checkpoint), which may be deleted after.
An EAGLE draft lands in ``DIR`` in the speculators package's layout (engine/spec_decode/eagle_checkpoint.py),
served with ``--speculative-config '{"method": "eagle", "model": "DIR"}'``; its run resumes
from ``DIR/work`` as well. So does an EAGLE-3 draft (engine/spec_decode/eagle3_checkpoint.py), served
with ``"method": "eagle3"``.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Iterable
from importlib import resources
from itertools import zip_longest
from pathlib import Path
from typing import TYPE_CHECKING, Any

from engine_args.config import numerics_fields
from engine_args.flags import add_device_argument, add_numerics_arguments
from splitserve.perplexity import DEFAULT_TEXT, default_text

if TYPE_CHECKING:  # annotations only: importing them loads torch
    from engine.llm import LLM
    from engine.spec_decode.draft_training import SelfDistillation, TrainedDraft
    from engine.spec_decode.medusa_training import HeadTraining

logger = logging.getLogger(__name__)

CHAT_QUESTIONS = "chat_questions.txt"  # everyday questions, one a line (splitserve/data/README.md)
# Instructions over the shipped text's paragraphs: chat turns of several kinds (continuing,
# summarising, explaining, rewriting), as a chat model's users send.
INSTRUCTIONS = (
    "Continue this passage in the same style:\n\n{}",
    "Summarize this passage in two sentences:\n\n{}",
    "What does this passage tell us about the people in it?\n\n{}",
    "Rewrite this passage in plain modern English:\n\n{}",
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from engine.spec_decode.eagle3_training import Eagle3Training
    from engine.spec_decode.eagle_training import DraftTraining
    from engine.spec_decode.medusa_training import HeadTraining

    defaults = HeadTraining()
    parser.add_argument(
        "--method",
        required=True,
        choices=["medusa", "eagle", "eagle3"],
        help="medusa: heads on the last hidden state; eagle: a one-layer EAGLE draft over the model's features; "
        "eagle3: a one-layer EAGLE-3 draft over three of the model's layers, with a vocabulary of its own",
    )
    add_numerics_arguments(parser)
    add_device_argument(parser)
    parser.add_argument("--output", type=Path, required=True, help="folder for the heads (created)")
    parser.add_argument(
        "--prompts-file",
        type=Path,
        default=None,
        help=f"prompts, one a line (default: splitserve/data/{CHAT_QUESTIONS} and instructions over paragraphs of "
        f"splitserve/data/{DEFAULT_TEXT})",
    )
    parser.add_argument(
        "--num-prompts",
        type=int,
        default=520,
        help="prompts to generate from, at most (default: 520, all the shipped ones: 320 questions and 200 "
        "instructions over the shipped text's paragraphs, interleaved)",
    )
    parser.add_argument(
        "--max-new-tokens",
        type=int,
        default=defaults.max_new_tokens,
        help=f"tokens of each greedy continuation (default: {defaults.max_new_tokens})",
    )
    parser.add_argument(
        "--num-heads", type=int, default=defaults.num_heads, help=f"medusa (default: {defaults.num_heads})"
    )
    parser.add_argument(
        "--num-layers",
        type=int,
        default=defaults.num_layers,
        help=f"medusa: residual blocks per head; eagle: decoder layers of the draft (default: {defaults.num_layers})",
    )
    parser.add_argument(
        "--steps",
        type=int,
        default=None,
        help=f"medusa (default: {defaults.num_steps}); eagle, eagle3 (default: {DraftTraining().num_steps})",
    )
    parser.add_argument(
        "--batch-size",
        type=int,
        default=None,
        help=f"medusa: positions a step (default: {defaults.batch_size}); eagle: whole sequences a step (default: "
        f"{DraftTraining().sequences_per_step})",
    )
    parser.add_argument(
        "--learning-rate", type=float, default=defaults.learning_rate, help=f"(default: {defaults.learning_rate})"
    )
    parser.add_argument("--seed", type=int, default=defaults.seed, help=f"(default: {defaults.seed})")
    parser.add_argument(
        "--draft-vocab-size",
        type=int,
        default=Eagle3Training().draft_vocab_size,
        help="eagle3: the draft vocabulary's tokens at most, the continuations' most used "
        f"(default: {Eagle3Training().draft_vocab_size})",
    )


def run(args: argparse.Namespace) -> int:
    from engine.llm import LLM

    llm = LLM(**numerics_fields(args))
    texts, source = prompt_texts(args.prompts_file, args.num_prompts)
    prompts = [_encode(llm, text) for text in texts]
    if args.method == "eagle":
        return _run_eagle(args, llm, prompts, source)
    if args.method == "eagle3":
        return _run_eagle3(args, llm, prompts, source)
    from engine.spec_decode.medusa_checkpoint import save_medusa_heads
    from engine.spec_decode.medusa_training import make_training_data, served_lm_head_weight, train_heads

    settings = medusa_settings(args)
    work = args.output / "work"
    data = make_training_data(llm, prompts, settings, work, _progress)
    heads, heldout = train_heads(data, served_lm_head_weight(llm), settings, work, _progress)
    extra = {
        "base_model": str(llm.engine.model_path),
        "training": {
            "method": "self-distillation: the base model's greedy continuations, hard labels",
            "prompts": source,
            "num_prompts": len(prompts),
            "max_new_tokens": settings.max_new_tokens,
            "num_positions": int(data.hidden.shape[0]),
            "num_steps": settings.num_steps,
            "batch_size": settings.batch_size,
            "learning_rate": settings.learning_rate,
            "dtype": str(llm.engine.runner.dtype).removeprefix("torch."),
        },
        "heldout": {
            "num_positions": heldout.num_positions,
            "top1_accuracy": [round(a, 4) for a in heldout.top1_accuracy],
            "mean_accepted_drafts": round(heldout.mean_accepted_drafts, 4),
        },
    }
    save_medusa_heads(heads, args.output, llm.engine.vocab_size, extra)
    return _trained(
        extra["heldout"],
        "Medusa heads in %s: held-out top-1 accuracy per head %s, about %.2f drafts accepted a step",
        args.output,
        extra["heldout"]["top1_accuracy"],  # type: ignore[index]
        heldout.mean_accepted_drafts,
    )


def _run_eagle(args: argparse.Namespace, llm: LLM, prompts: list[list[int]], source: str) -> int:
    from engine.spec_decode.eagle_checkpoint import save_eagle_draft
    from engine.spec_decode.eagle_training import DraftTraining, train_eagle

    settings = DraftTraining(num_layers=args.num_layers, **self_distillation_fields(args))
    trained = train_eagle(llm, prompts, settings, args.output / "work", _progress)
    extra = _draft_record(llm, prompts, source, settings, trained, "its features")
    # The speculators package's layout, which vLLM reads too; it holds one-layer drafts only.
    layout = "speculators" if settings.num_layers == 1 else "eagle"
    save_eagle_draft(trained.draft, args.output, layout, extra)
    return _trained(
        extra["heldout"],
        "EAGLE draft in %s (%s layout): held-out top-1 accuracy of the first draft %.3f",
        args.output,
        layout,
        trained.heldout_top1_accuracy,
    )


def _run_eagle3(args: argparse.Namespace, llm: LLM, prompts: list[list[int]], source: str) -> int:
    from engine.spec_decode.eagle3_checkpoint import save_eagle3_draft
    from engine.spec_decode.eagle3_training import Eagle3Training, train_eagle3

    settings = Eagle3Training(draft_vocab_size=args.draft_vocab_size, **self_distillation_fields(args))
    trained = train_eagle3(llm, prompts, settings, args.output / "work", _progress)
    extra = _draft_record(llm, prompts, source, settings, trained, "three of its layers")
    save_eagle3_draft(trained.draft, args.output, "speculators", extra)
    return _trained(
        extra["heldout"],
        "EAGLE-3 draft in %s (speculators layout, a vocabulary of %d): held-out top-1 accuracy of the first draft %.3f",
        args.output,
        trained.draft.eagle3.draft_vocab_size,
        trained.heldout_top1_accuracy,
    )


def _trained(heldout: object, message: str, *args: object) -> int:
    """Every method's end: ``message`` logged, the held-out figures on stdout (for scripts)."""
    logger.info(message, *args)
    sys.stdout.write(json.dumps(heldout) + "\n")
    return 0


def medusa_settings(args: argparse.Namespace) -> HeadTraining:
    """Medusa heads' training settings from the flags."""
    from engine.spec_decode.medusa_training import HeadTraining

    return HeadTraining(
        num_heads=args.num_heads,
        num_layers=args.num_layers,
        max_new_tokens=args.max_new_tokens,
        num_steps=args.steps if args.steps is not None else HeadTraining().num_steps,
        batch_size=args.batch_size or HeadTraining().batch_size,
        learning_rate=args.learning_rate,
        seed=args.seed,
    )


def self_distillation_fields(args: argparse.Namespace) -> dict[str, Any]:
    """The settings an EAGLE and an EAGLE-3 draft's training share (draft_training.SelfDistillation)."""
    from engine.spec_decode.draft_training import SelfDistillation

    return {
        "max_new_tokens": args.max_new_tokens,
        "num_steps": args.steps if args.steps is not None else SelfDistillation().num_steps,
        "sequences_per_step": args.batch_size or SelfDistillation().sequences_per_step,
        "learning_rate": args.learning_rate,
        "seed": args.seed,
    }


def _draft_record(
    llm: LLM,
    prompts: list[list[int]],
    source: str,
    settings: SelfDistillation,
    trained: TrainedDraft[Any],
    features: str,
) -> dict[str, Any]:
    """What an EAGLE or EAGLE-3 draft's config says of its training (``features``: what of the
    model it read along the continuations, in words)."""
    return {
        "base_model": str(llm.engine.model_path),
        "training": {
            "method": f"self-distillation: the base model's greedy continuations and {features} along them",
            "prompts": source,
            "num_prompts": len(prompts),
            "max_new_tokens": settings.max_new_tokens,
            "num_sequences": trained.num_sequences,
            "num_positions": trained.num_positions,
            "num_steps": settings.num_steps,
            "sequences_per_step": settings.sequences_per_step,
            "learning_rate": settings.learning_rate,
            "dtype": str(llm.engine.runner.dtype).removeprefix("torch."),
        },
        "heldout": {
            "num_positions": trained.num_heldout_positions,
            "top1_accuracy": round(trained.heldout_top1_accuracy, 4),
        },
    }


def prompt_texts(prompts_file: Path | None, num_prompts: int) -> tuple[list[str], str]:
    """The prompts' texts and where they came from, in words."""
    if prompts_file is not None:
        lines = [line.strip() for line in prompts_file.read_text(encoding="utf-8").splitlines() if line.strip()]
        if not lines:
            raise ValueError(f"{prompts_file} holds no prompts (one a line)")
        return lines[:num_prompts], f"{prompts_file} ({min(num_prompts, len(lines))} lines)"
    paragraphs = [" ".join(p.split()) for p in default_text().split("\n\n")]
    paragraphs = [p[:1200] for p in paragraphs if len(p) >= 200]
    # Each paragraph under one instruction, then under the next, and so on: every pairing once,
    # since a greedy continuation of the same prompt teaches nothing new.
    instructed: list[str] = []
    for shift in range(len(INSTRUCTIONS)):
        instructed += [INSTRUCTIONS[(i + shift) % len(INSTRUCTIONS)].format(p) for i, p in enumerate(paragraphs)]
    questions = [line.strip() for line in _shipped(CHAT_QUESTIONS).splitlines() if line.strip()]
    # Interleaved, so that fewer prompts still mix everyday chat with the longer passages.
    texts = [text for pair in zip_longest(questions, instructed) for text in pair if text is not None]
    return texts[:num_prompts], (
        f"the {len(questions)} questions of splitserve/data/{CHAT_QUESTIONS} and instructions ({len(INSTRUCTIONS)} "
        f"kinds) over {len(paragraphs)} paragraphs of splitserve/data/{DEFAULT_TEXT}, interleaved"
    )


def _shipped(name: str) -> str:
    return (resources.files("splitserve") / "data" / name).read_text(encoding="utf-8")


def _encode(llm: LLM, text: str) -> list[int]:
    tokenizer = llm.tokenizer
    if tokenizer.chat_template is not None:
        messages = [{"role": "user", "content": text}]
        encoded = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True)
        return list(encoded["input_ids"])
    return list(tokenizer.encode(text))


def _progress(items: Iterable[int], description: str, total: int) -> Iterable[int]:
    from tqdm import tqdm

    return tqdm(items, desc=description, total=total, unit="shard" if description == "generating" else "step")
