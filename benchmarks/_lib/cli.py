"""The flags the GPU benchmarks share (and ``benchmarks/gpu_check.sh`` passes), and their parsing.

    --json PATH    the report, rewritten after every configuration (``report.Report``)
    --plot PATH    a PNG at the end
    --device       cuda where there is one, else cpu
    --reps N       timed calls per configuration
    --smoke        tiny sizes on any device (CPU: the torch kernels)
    --long         the long sweep (the default fits a short GPU session)
    --dry-run      smoke sizes on CPU, one rep, the report marked dry_run, never under benchmarks/results/
"""

from __future__ import annotations

import argparse

import torch

from .report import output_path


def parser(doc: str) -> argparse.ArgumentParser:
    """An argument parser whose --help prints the script's docstring as written."""
    return argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)


def add_common_args(parser: argparse.ArgumentParser, *, reps: int = 10, device: str | None = None,
                    smoke: bool = True) -> None:
    """The common flags (module doc); ``device`` None: cuda where available, else cpu."""
    parser.add_argument("--json", help="write the report here (rewritten after every configuration)")
    parser.add_argument("--plot", help="write a PNG here at the end")
    parser.add_argument("--device", default=device or ("cuda" if torch.cuda.is_available() else "cpu"))
    parser.add_argument("--reps", type=int, default=reps, help=f"timed calls per configuration (default {reps})")
    if smoke:
        parser.add_argument("--smoke", action="store_true", help="tiny sizes (CI and CPU)")
    parser.add_argument("--long", action="store_true", help="the long sweep (the default fits a short GPU session)")
    parser.add_argument("--dry-run", action="store_true",
                        help="smoke sizes on CPU, one rep, report marked dry_run, never under benchmarks/results/")


def parse_args(parser: argparse.ArgumentParser, argv, name: str) -> argparse.Namespace:
    """Parse; a dry run becomes smoke sizes on CPU with one rep, its report in a temporary folder
    (``name`` there) unless --json says where, and never under benchmarks/results/."""
    args = parser.parse_args(argv)
    if args.dry_run:
        args.smoke, args.device, args.reps = True, "cpu", 1
        args.json = output_path(args.json, True, name)
        if args.plot:
            output_path(args.plot, True, name)
        print(f"dry run (CPU, no GPU result): {args.json}", flush=True)
    return args
