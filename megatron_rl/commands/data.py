"""`megatron-rl data prepare igakuqa|medmcqa ...`: write RL prompt and SFT JSONL files.

Only argparse is imported at module level; the data modules load when the command runs, and none
of them imports torch.
"""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from megatron_rl.data.prepare import PrepareResult


def year_list(text: str) -> list[int]:
    """"2018,2019" → [2018, 2019]; "" → [] (e.g. no evaluation years)."""
    years = []
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        if not part.isdigit() or len(part) != 4:
            raise argparse.ArgumentTypeError(f"not a year: {part!r}")
        years.append(int(part))
    return years


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("data", help="prepare training and evaluation data")
    verbs = parser.add_subparsers(dest="verb", metavar="VERB", required=True)
    prepare = verbs.add_parser("prepare", help="convert a source dataset to prompt/SFT JSONL")
    sources = prepare.add_subparsers(dest="source", metavar="SOURCE", required=True)

    igaku = sources.add_parser("igakuqa", help="IgakuQA (Japanese medical licensing exam)")
    igaku.add_argument("--src", required=True, help="IgakuQA directory (checkout or its data/)")
    igaku.add_argument("--out", required=True, help="output directory")
    igaku.add_argument("--years", type=year_list, default=None,
                       help="training years, e.g. 2018,2019 (default: all but --eval-years)")
    igaku.add_argument("--eval-years", type=year_list, default=[2022],
                       help="evaluation years (default: 2022)")
    igaku.add_argument("--train-text-only", action="store_true",
                       help="leave questions whose image is missing out of training")
    _add_on_malformed(igaku)
    igaku.set_defaults(func=run_igakuqa)

    med = sources.add_parser("medmcqa", help="MedMCQA (English medical MCQ, options a-d)")
    med.add_argument("--src", required=True, help="MedMCQA JSONL file")
    med.add_argument("--out", required=True, help="output directory")
    med.add_argument("--split", default="train", help="name used in the output file names")
    med.add_argument("--cop-base", type=int, choices=(0, 1), default=1,
                     help="1 for the original release (cop 1-4), 0 for the HF copy (0-3)")
    _add_on_malformed(med)
    med.set_defaults(func=run_medmcqa)


def _add_on_malformed(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--on-malformed", choices=("error", "skip"), default="error",
                        help="stop at the first malformed line (default) or skip and count")


def _report(result: PrepareResult) -> int:
    for name, count in result.counts.items():
        print(f"{result.files[name]}: {count} records")
    for reason, count in sorted(result.excluded.items()):
        print(f"excluded from training: {count} ({reason})")
    if result.skipped_lines:
        print(f"skipped {result.skipped_lines} malformed lines (see {result.files['summary']})")
    return 0


def run_igakuqa(args: argparse.Namespace) -> int:
    from megatron_rl.data.prepare import prepare_igakuqa
    from megatron_rl.data.schema import DataError

    try:
        result = prepare_igakuqa(args.src, args.out, train_years=args.years,
                                 eval_years=args.eval_years, on_malformed=args.on_malformed,
                                 train_text_only=args.train_text_only)
    except (DataError, ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return _report(result)


def run_medmcqa(args: argparse.Namespace) -> int:
    from megatron_rl.data.prepare import prepare_medmcqa
    from megatron_rl.data.schema import DataError

    try:
        result = prepare_medmcqa(args.src, args.out, split=args.split, cop_base=args.cop_base,
                                 on_malformed=args.on_malformed)
    except (DataError, ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return _report(result)
