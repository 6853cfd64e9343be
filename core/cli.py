"""The ``dpro`` command line: ``dpro info RUN`` (more subcommands join as the pipeline grows).

Each subcommand is two small functions: ``_add_<name>(subparsers)`` declares its arguments and
``_cmd_<name>(args) -> int`` runs it; ``SUBCOMMANDS`` lists the declarers in the order ``--help``
shows them. A ``DproError`` becomes ``dpro: error: <message>`` on stderr and exit status 2; argument
mistakes are reported by argparse (also status 2).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from typing import Any

from dpro import __version__
from dpro.errors import DproError

EXIT_ERROR = 2


def _add_info(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "info", help="what a run directory holds: engine, ranks, steps, events, problems",
        description="Load and validate a run directory and summarize it: engine, world size, hosts, knobs, "
                    "per-rank state and event counts, and any problem found (missing or crashed ranks).",
    )
    parser.add_argument("run", metavar="RUN", help="the run directory (holds run.json and rank-<r>.json)")
    parser.add_argument("--json", action="store_true", help="print the summary as JSON instead of text")
    parser.set_defaults(func=_cmd_info)


def _cmd_info(args: argparse.Namespace) -> int:
    from dpro.info import format_run_summary, summarize_run
    from dpro.load import load_run

    summary = summarize_run(load_run(args.run))
    print(json.dumps(summary, indent=2) if args.json else format_run_summary(summary))
    return 0


def _add_analyze(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "analyze", help="replay the step DAG: predicted vs measured step time, breakdown, critical path",
        description="Align the ranks' clocks, build the global DAG of a training step, replay it and report the "
                    "measured and predicted step time with the prediction error, where the time goes, the "
                    "critical path and stragglers. Writes analysis/replay.json (measured and replayed timelines, "
                    "open in Perfetto). Accepts a dpro run directory or PyTorch profiler traces "
                    "(*.pt.trace.json[.gz], one per rank).",
    )
    parser.add_argument("run", metavar="RUN", nargs="+", help="a run directory, or PyTorch profiler trace files")
    parser.add_argument("--json", action="store_true", help="print the analysis as one JSON object")
    parser.add_argument("--iterations", type=int, default=4, help="consecutive steps to replay (default 4)")
    parser.set_defaults(func=_cmd_analyze)


def _cmd_analyze(args: argparse.Namespace) -> int:
    from pathlib import Path

    from dpro.analyze import analyze_path
    from dpro.report import format_analysis

    if len(args.run) == 1 and Path(args.run[0]).is_dir():
        analysis = analyze_path(args.run[0], iterations=args.iterations)
    else:
        from dpro.kineto import analyze_kineto

        analysis = analyze_kineto([Path(p) for p in args.run])
    print(json.dumps(analysis.to_json(), indent=2) if args.json else format_analysis(analysis))
    return 0


SUBCOMMANDS: tuple[Callable[[Any], None], ...] = (_add_info, _add_analyze)


def build_parser() -> argparse.ArgumentParser:
    """The ``dpro`` argument parser with every subcommand in ``SUBCOMMANDS``."""
    parser = argparse.ArgumentParser(
        prog="dpro",
        description="Profile distributed training, replay its step DAG, and apply a better configuration.",
    )
    parser.add_argument("--version", action="version", version=f"dpro {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for add in SUBCOMMANDS:
        add(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``dpro`` with ``argv`` (default ``sys.argv[1:]``); return the exit status.

    Raises:
        SystemExit: from argparse, for ``--help``, ``--version`` and wrong arguments.
    """
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except DproError as err:
        print(f"dpro: error: {err}", file=sys.stderr)
        return EXIT_ERROR
