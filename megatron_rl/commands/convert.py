"""`megatron-rl convert hf-to-mcore --hf DIR --out DIR [--tp N --pp N --ep N --etp N]` and
`megatron-rl convert mcore-to-hf --mcore DIR --out DIR [--tp N ...]`.

Runs pp × lcm(tp, ep × etp) CPU worker processes (torchrun via `megatron_rl.launch`, gloo); each holds only its
shard of the model. Exit status: 0 converted, 1 failed (the error lists every missing, unexpected
or mis-shaped tensor; no output directory is left behind).
"""

from __future__ import annotations

import argparse


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("convert", help="convert checkpoints between Hugging Face and Megatron",
                            description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    verbs = parser.add_subparsers(dest="verb", metavar="DIRECTION", required=True)
    to_mcore = verbs.add_parser("hf-to-mcore", help="HF safetensors → Megatron torch_dist checkpoint")
    to_mcore.add_argument("--hf", required=True, help="HF checkpoint directory (config.json + safetensors)")
    to_mcore.add_argument("--dtype", help="Megatron params dtype (default: widest dtype in the HF files)")
    to_hf = verbs.add_parser("mcore-to-hf", help="Megatron torch_dist checkpoint → HF safetensors")
    to_hf.add_argument("--mcore", required=True, help="Megatron checkpoint directory (with complete.json)")
    to_hf.add_argument("--hf-config", help="HF config dir or config.json, if the checkpoint records none")
    to_hf.add_argument("--dtype", help="dtype of every written tensor (default: as before conversion)")
    to_hf.add_argument("--max-shard-size", default="5GB", help="largest safetensors shard (default 5GB)")
    for p in (to_mcore, to_hf):
        p.add_argument("--out", required=True, help="output directory (must not exist unless --force)")
        p.add_argument("--tp", type=int, default=1, help="tensor parallel size of the worker layout")
        p.add_argument("--pp", type=int, default=1, help="pipeline parallel size")
        p.add_argument("--ep", type=int, default=1, help="expert parallel size")
        p.add_argument("--etp", type=int, default=None, help="expert tensor parallel size (default: --tp)")
        p.add_argument("--force", action="store_true", help="replace --out if it exists")
        p.add_argument("--no-progress", action="store_true", help="no progress lines")
        p.add_argument("--stats-json", help="write timings and per-worker peak RSS to this file")
        p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import sys

    from ..convert.job import DEFAULT_MAX_SHARD_BYTES, HF_TO_MCORE, ConvertJob, ConvertLayout, parse_size
    from ..convert.launcher import run_conversion

    try:
        max_shard = parse_size(args.max_shard_size) if hasattr(args, "max_shard_size") else DEFAULT_MAX_SHARD_BYTES
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    job = ConvertJob(
        direction=args.verb,
        src=args.hf if args.verb == HF_TO_MCORE else args.mcore,
        out=args.out,
        layout=ConvertLayout(tp=args.tp, pp=args.pp, ep=args.ep, etp=args.etp),
        dtype=args.dtype,
        hf_config=getattr(args, "hf_config", None),
        max_shard_bytes=max_shard,
        progress=not args.no_progress,
        stats_file=args.stats_json,
    )
    return run_conversion(job, force=args.force)
