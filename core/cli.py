"""The ``dpro`` command line: ``dpro info | analyze | whatif | optimize | report | compare | export | import-xplane``.

Each subcommand is two small functions: ``_add_<name>(subparsers)`` declares its arguments and
``_cmd_<name>(args) -> int`` runs it; ``SUBCOMMANDS`` lists the declarers in the order ``--help``
shows them. A ``DproError`` (or a file that cannot be read or written) becomes one line,
``dpro: error: <message>``, on stderr and exit status 2; ``-v`` adds the traceback, for bug reports. Argument
mistakes are reported by argparse (also status 2).
"""

from __future__ import annotations

import argparse
import json
import sys
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from dpro import __version__
from dpro.errors import DproError
from dpro.logs import set_verbosity

__all__ = [
    "EXIT_ERROR",
    "build_parser",
    "report_error",
    "parse_size",
]


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
    from dpro.engines import load_prepared
    from dpro.report.info import format_run_summary, summarize_run

    summary = summarize_run(load_prepared(args.run))
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
    parser.add_argument("--jobs", type=_positive_int, default=None, metavar="N",
                        help="processes that read a big run or many traces (default: $DPRO_JOBS, else the usable CPUs)")
    parser.set_defaults(func=_cmd_analyze)


def _cmd_analyze(args: argparse.Namespace) -> int:

    from dpro.analyze import analyze_dir
    from dpro.io.pool import collector_paused
    from dpro.record.trace import analysis_file
    from dpro.report.perfetto import write_analyzed_replay
    from dpro.report.text import format_analysis

    paths = _trace_paths(args.run)
    if paths:
        from dpro.analyze.traces import analyze_kineto

        analysis = analyze_kineto(paths, jobs=args.jobs)
    else:
        with collector_paused():
            result = analyze_dir(args.run[0], iterations=args.iterations, jobs=args.jobs)
            write_analyzed_replay(analysis_file(args.run[0], "replay.json"), result)
        analysis = result.analysis
    print(json.dumps(analysis.to_json(), indent=2) if args.json else format_analysis(analysis))
    return 0


def _trace_paths(given: list[str]) -> list[Path]:
    """The profiler traces ``given`` names: the files themselves, or those a run directory recorded by the profiler
    holds (``dpro.io.kineto.run_trace_files``); empty for a run directory of dpro's own traces."""
    from dpro.io.kineto import run_trace_files

    if len(given) == 1 and Path(given[0]).is_dir():
        return run_trace_files(given[0])
    return [Path(p) for p in given]


def _positive_int(text: str) -> int:
    """An argparse type: a whole number of at least 1 (``--jobs``)."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: give a whole number of processes, at least 1")
    return value


def _knob_help() -> str:
    """The what-if knobs, one line each, from the one knob table (``dpro.config.knob_table``)."""
    from dpro.config import knob_table

    rows = [f"  {k.name:<32} {k.doc}" + (f" [{k.engine}]" if k.engine else "")
            for k in knob_table().values() if k.whatif]
    return "knobs (KNOB=VALUE; values are JSON where they parse, recompute also takes a,b,c):\n" + "\n".join(rows)


def _add_whatif(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "whatif", help="predict the step under changed knobs (bucket size, bandwidth, world size, ...)",
        description="Rebuild the step DAG of a run under changed knobs and replay it.",
        epilog=_knob_help(), formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("run", metavar="RUN", nargs="+",
                        help="a run directory, or PyTorch profiler trace files (one per rank: bandwidth_scale, "
                             "world_size and compute_scale only)")
    parser.add_argument("--set", dest="settings", metavar="KNOB=VALUE", action="append", default=[],
                        help="a knob to change (repeatable)")
    parser.add_argument("--json", action="store_true", help="print the prediction as one JSON object")
    parser.set_defaults(func=_cmd_whatif)


def _cmd_whatif(args: argparse.Namespace) -> int:

    from dpro.engines import load_prepared
    from dpro.sim.whatif import context, parse_settings, predict

    knobs = parse_settings(args.settings)
    paths = _trace_paths(args.run)
    if paths:
        return _whatif_traces(paths, knobs, args)
    ctx = context(load_prepared(args.run[0]))
    base, changed = predict(ctx, {}), predict(ctx, knobs)
    result = {
        "knobs": knobs,
        "measured_step_ms": ctx.base.measured_step_us / 1000.0,
        "baseline_predicted_step_ms": base.predicted_step_ms,
        "as_recorded_step_ms": ctx.as_recorded_ms if ctx.as_recorded_ms is not None else base.predicted_step_ms,
        "recording_cost_pct": ctx.recording.pct if ctx.recording is not None else None,
        "predicted_step_ms": changed.predicted_step_ms,
        "change_pct": 100.0 * (changed.predicted_step_ms / base.predicted_step_ms - 1.0),
        "graph_nodes": changed.graph_nodes,
        "baseline_peak_memory_bytes": base.predicted_peak_memory_bytes,
        "predicted_peak_memory_bytes": changed.predicted_peak_memory_bytes,
        "comm_model": {"latency_us": ctx.comm.latency_us, "gbit_per_s": ctx.comm.gbit_per_s,
                       "fitted_on": ctx.comm.source},
    }
    if changed.spread:
        result["spread"] = changed.spread
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    from dpro.report.tables import format_bytes, format_table

    rows = [["measured (this run)", f"{result['measured_step_ms']:.2f}", "", ""]]
    if ctx.as_recorded_ms is not None and ctx.recording is not None:
        rows += [["replayed as recorded", f"{ctx.as_recorded_ms:.2f}", "", ""],
                 [f"without recording's cost ({ctx.recording.pct:+.1f}%)", f"{base.predicted_step_ms:.2f}",
                  format_bytes(base.predicted_peak_memory_bytes), ""]]
    else:
        rows.append(["replayed as recorded", f"{base.predicted_step_ms:.2f}",
                     format_bytes(base.predicted_peak_memory_bytes), ""])
    rows.append([" ".join(args.settings) or "(no change)", f"{changed.predicted_step_ms:.2f}",
                 format_bytes(changed.predicted_peak_memory_bytes), f"{result['change_pct']:+.1f}%"])
    print(format_table(["configuration", "step ms", "peak memory", "change"], rows, align="<>>>"))
    if changed.spread:
        seeds = ", ".join(f"{v:.2f}" for v in changed.spread["seeds"])
        print(f"\n{args.settings and ' '.join(args.settings)}: more ranks than recorded, each drawing its op times "
              f"from the recorded steps; p50 {changed.spread['p50']:.2f} ms, p90 {changed.spread['p90']:.2f} ms "
              f"over {len(changed.spread['seeds'])} draws ({seeds})")
    from dpro.engines import get_engine

    own = get_engine(ctx.engine).describe_model(ctx)
    print("\n" + (own or f"communication model: {ctx.comm.latency_us:.1f} us latency, {ctx.comm.gbit_per_s:.2f} "
                          f"Gbit/s (fitted on {ctx.comm.source})"))
    return 0


def _whatif_traces(paths: list[Any], knobs: dict[str, Any], args: argparse.Namespace) -> int:
    from dpro.analyze.traces import whatif_traces
    from dpro.io.kineto import load_traces
    from dpro.report.tables import format_table

    result = whatif_traces(load_traces(paths), knobs)
    base, changed = result["baseline_predicted_step_ms"], result["predicted_step_ms"]
    result["change_pct"] = 100.0 * (changed / base - 1.0) if base else float("nan")
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    rows = [["measured (the traces)", f"{result['measured_step_ms']:.2f}", ""],
            ["replayed, every op at its mean", f"{base:.2f}", ""],
            [" ".join(args.settings) or "(no change)", f"{changed:.2f}", f"{result['change_pct']:+.1f}%"]]
    if "buckets" in result:
        rows.insert(2, [f"recorded {result['recorded_buckets']} bucket(s), allreduces priced by the model",
                        f"{result['recorded_buckets_modelled_step_ms']:.2f}", ""])
    print(format_table(["configuration", "step ms", "change"], rows, align="<>>"))
    if "buckets" in result:
        print(f"\n{result['gradients']} gradients ({result['gradient_bytes'] / 2**20:.2f} MiB, sizes and ready order "
              f"from the traces' AccumulateGrad) in {result['recorded_buckets']} -> {result['buckets']} bucket(s); "
              f"{result['comm_model']}")
    print(f"\ncommunication scaled as a ring's bytes per link from {result['recorded_world_size']} ranks; compute "
          "scaled on the device (the host operators in a CPU-only trace)")
    print(result["interference"])
    return 0


def _add_optimize(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "optimize", help="search bucket sizes, tensor groups, recomputation; write config.json",
        description="Search strategies (the engine's knobs, e.g. bucket sizes or fusion thresholds; tensor grouping by "
                    "dynamic programming; recomputation under a memory budget; gradient compression), confirm each "
                    "by replay, and write the applied "
                    "config (default RUN/analysis/config.json) that the plugins and dpro-launch apply.",
    )
    parser.add_argument("run", metavar="RUN", nargs="+",
                        help="a run directory, or PyTorch profiler CPU trace files of a gloo data-parallel job "
                             "recorded with record_shapes=True (one per rank: the bucket size only)")
    parser.add_argument("--memory-budget", metavar="SIZE", help="peak memory per rank, e.g. 2GiB, 500MB")
    parser.add_argument("--allow-compression", action="store_true", help="may recommend fp16 gradient compression")
    parser.add_argument("--allow-precision", action="store_true",
                        help="may recommend autocast (amp), where the probe passes measured it faster")
    parser.add_argument("-o", "--output", metavar="FILE", help="where to write config.json")
    parser.add_argument("--json", action="store_true", help="print the config as JSON")
    parser.set_defaults(func=_cmd_optimize)


def parse_size(text: str) -> int:
    """'2GiB', '500MB', '1.5G', '1048576' -> bytes."""
    from dpro.errors import UsageError

    units = {"": 1, "B": 1, "K": 1024, "KB": 1000, "KIB": 1024, "M": 2**20, "MB": 10**6, "MIB": 2**20,
             "G": 2**30, "GB": 10**9, "GIB": 2**30}
    raw = text.strip().upper()
    number = raw.rstrip("KMGIB")
    unit = raw[len(number):]
    try:
        value = float(number)
    except ValueError:
        value = -1.0
    if unit not in units or value <= 0:
        raise UsageError(f"--memory-budget {text!r}: expected a size such as 2GiB, 500MB or 1048576")
    return int(value * units[unit])


def _cmd_optimize(args: argparse.Namespace) -> int:
    from dpro.engines import load_prepared
    from dpro.optimize import config_document, optimize, write_config_files
    from dpro.progress import Progress
    from dpro.sim.whatif import context

    paths = _trace_paths(args.run)
    if paths:
        return _optimize_traces(paths, args)
    budget = parse_size(args.memory_budget) if args.memory_budget else None
    ctx = context(load_prepared(args.run[0]))
    result = optimize(ctx, memory_budget_bytes=budget, allow_compression=args.allow_compression,
                      allow_precision=args.allow_precision, progress=Progress(None, "optimize"))
    doc = config_document(result, ctx)
    from dpro.record.trace import analysis_file

    out = Path(args.output) if args.output else analysis_file(args.run[0], "config.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    written = write_config_files(out, doc)
    if args.json:
        print(json.dumps(doc, indent=2))
        return 0
    print(f"measured step      {result.measured_step_ms:9.2f} ms")
    if ctx.as_recorded_ms is not None and ctx.recording is not None:
        print(f"replayed recorded  {ctx.as_recorded_ms:9.2f} ms")
        print(f"replayed baseline  {result.baseline.predicted_step_ms:9.2f} ms  (recording's measured cost "
              f"{ctx.recording.pct:+.1f}% taken out)")
    else:
        print(f"replayed baseline  {result.baseline.predicted_step_ms:9.2f} ms")
    print(f"predicted          {result.predicted.predicted_step_ms:9.2f} ms  "
          f"({100 * (result.predicted.predicted_step_ms / result.baseline.predicted_step_ms - 1):+.1f}%)")
    print(f"search time        {result.search_seconds:9.3f} s\n")
    for item in result.explain:
        print(f"  {item['knob']:<26} {item['predicted_gain_ms']:+8.2f} ms  {item['why']}")
    print(f"\nknobs: {json.dumps({k: v for k, v in result.knobs.items() if k != 'tensor_groups'})}"
          + (" (+ tensor_groups)" if "tensor_groups" in result.knobs else ""))
    print(f"config written to {out}")
    for other in written[1:]:
        print(f"{other.name} written beside it (the engine's launcher reads it)")
    return 0


def _optimize_traces(paths: list[Any], args: argparse.Namespace) -> int:
    from dpro.engines import REGISTRY, get_engine
    from dpro.errors import UsageError
    from dpro.io.kineto import load_traces
    from dpro.io.load import load_run_json
    from dpro.record.trace import analysis_file
    from dpro.report.tables import format_bytes, format_table

    if args.allow_compression or args.allow_precision:
        raise UsageError("on profiler traces dpro optimize searches the engine's bucket size or resharding only (no "
                         "--allow-compression, --allow-precision): record the job with dpro (dpro-launch --profile) "
                         "for the rest")
    budget = parse_size(args.memory_budget) if args.memory_budget else None
    meta = load_run_json(Path(args.run[0]) / "run.json") if (Path(args.run[0]) / "run.json").is_file() else None
    traces = load_traces(paths)
    searches = [get_engine(name).trace_optimize for name in REGISTRY if get_engine(name).trace_optimize]
    result, refusals = None, []
    for search in searches:
        try:
            result = search(traces, budget, meta)
            break
        except UsageError as err:  # not this engine's traces
            refusals.append(err)
    if result is None:
        raise refusals[0] if refusals else UsageError("no engine searches profiler traces")
    out = Path(args.output) if args.output else analysis_file(args.run[0], "config.json") if Path(
        args.run[0]).is_dir() else Path(paths[0]).with_name("dpro-config.json")
    _write_config(out, result["config"])
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    if "recorded_buckets" in result:
        rows = [[f"{c['bucket_cap_mb']:g}", str(c["buckets"]), f"{c['predicted_step_ms']:.2f}"]
                for c in result["candidates"]]
        print(f"measured step {result['measured_step_ms']:.2f} ms; the recorded {result['recorded_buckets']} "
              f"bucket(s) replayed: {result['recorded_modelled_step_ms']:.2f} ms; {result['comm_model']}\n")
        print(format_table(["bucket cap MB", "buckets", "predicted ms"], rows, align=">>>"))
    else:
        print(f"measured step {result['measured_step_ms']:.2f} ms; replayed as recorded "
              f"{result['recorded_modelled_step_ms']:.2f} ms\n")
        peaks = [c.get("predicted_peak_memory_bytes") for c in result["candidates"]]
        rows = [[c["setting"], f"{c['predicted_step_ms']:.2f}", "" if peak is None else format_bytes(peak)]
                for c, peak in zip(result["candidates"], peaks, strict=True)]
        print(format_table(["setting", "predicted ms", "peak memory"], rows, align="<>>"))
    print("\n" + result["config"]["explain"][0]["why"])
    print(f"config written to {out} (made from traces: dpro-launch --apply FILE --force applies it)")
    return 0


def _add_import_xplane(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "import-xplane", help="turn a TensorBoard profile (*.xplane.pb) into a run directory",
        description="Read the TensorFlow profile(s) of a job (DIR/plugins/profile/<session>/<host>.xplane.pb, one "
                    "file per worker; DIR may also be a session folder or one file) and write a dpro run directory "
                    "that info, analyze and whatif read. Steps, layers and collectives are inferred from the "
                    "profile; gradient sizes are unknown. Needs the TensorFlow plugin (tensorflow installed).",
    )
    parser.add_argument("src", metavar="DIR", help="a TensorBoard log dir, a profile session folder or a .xplane.pb")
    parser.add_argument("-o", "--output", metavar="RUN_DIR", help="the new run directory (default: <DIR>-dpro)")
    parser.set_defaults(func=_cmd_import_xplane)


def _cmd_import_xplane(args: argparse.Namespace) -> int:
    from dpro.errors import UsageError

    try:  # the plugin imports TensorFlow; core stays framework-free until this command runs
        from dpro.plugins.tf.importer import import_xplane
    except ImportError as err:
        raise UsageError(f"dpro import-xplane needs TensorFlow ({err}); install dpro[tf]") from err
    out = import_xplane(args.src, args.output)
    print(f"run written to {out}")
    return 0


def _add_report(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "report", help="one self-contained HTML page: timeline, breakdown, communication, what-if, recommendations",
        description="Analyze a run directory (any engine) or PyTorch profiler traces and write one HTML file that "
                    "opens offline in any browser: the measured and predicted step with the error, a timeline of "
                    "one step per rank (measured above replayed, critical path outlined), where the step goes per "
                    "rank, communication per collective and stragglers, what-if curves (the engine's knobs, "
                    "bandwidth, world size, memory vs recomputation) and the optimizer's recommendation.",
    )
    parser.add_argument("run", metavar="RUN", nargs="+", help="a run directory, or PyTorch profiler trace files")
    parser.add_argument("-o", "--output", metavar="FILE",
                        help="where to write the page (default RUN/analysis/report.html; dpro-report.html for traces)")
    parser.add_argument("--no-whatif", action="store_true", help="leave out the what-if curves (faster)")
    parser.add_argument("--no-optimize", action="store_true", help="leave out the optimizer's recommendation")
    parser.set_defaults(func=_cmd_report)


def _cmd_report(args: argparse.Namespace) -> int:
    from dpro.record.trace import analysis_file, write_text_atomic
    from dpro.report.collect import collect_run, collect_traces
    from dpro.report.html import render_report

    paths = _trace_paths(args.run)
    if not paths:
        data = collect_run(args.run[0], whatif=not args.no_whatif, recommend=not args.no_optimize)
        out = Path(args.output) if args.output else analysis_file(args.run[0], "report.html")
    else:
        data = collect_traces(paths)
        out = Path(args.output) if args.output else Path("dpro-report.html")
    out.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(out, render_report(data))
    a = data.analysis
    print(f"measured {a.measured_step_ms:.2f} ms, predicted {a.predicted_step_ms:.2f} ms ({a.error_pct:+.2f} %)")
    print(f"report written to {out} ({out.stat().st_size / 1e6:.2f} MB)")
    return 0


def _add_compare(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "compare", help="what changed between two runs of one model, and what explains the difference",
        description="Analyze two run directories of one model (e.g. before and after a config) and show the knobs "
                    "that differ, measured and predicted steps, collectives, where each step goes and the parts "
                    "and ops that explain most of the difference. Runs of different models are refused.",
    )
    parser.add_argument("run_a", metavar="RUN_A", help="the reference run directory")
    parser.add_argument("run_b", metavar="RUN_B", help="the run directory compared with it")
    parser.add_argument("--json", action="store_true", help="print the comparison as one JSON object")
    parser.add_argument("-o", "--output", metavar="FILE", help="also write the comparison as an HTML page")
    parser.set_defaults(func=_cmd_compare)


def _cmd_compare(args: argparse.Namespace) -> int:
    from dpro.record.trace import write_text_atomic
    from dpro.report.compare import compare_runs, format_comparison, render_comparison

    comparison = compare_runs(args.run_a, args.run_b)
    print(json.dumps(comparison.to_json(), indent=2) if args.json else format_comparison(comparison))
    if args.output:
        out = Path(args.output)
        out.parent.mkdir(parents=True, exist_ok=True)
        write_text_atomic(out, render_comparison(comparison))
        print(f"comparison written to {out}", file=sys.stderr if args.json else sys.stdout)
    return 0


def _add_export(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "export", help="the step DAG for other tools: Chakra execution traces (ASTRA-sim), a Perfetto timeline",
        description="Write the DAG of a run directory (any engine) or of PyTorch profiler traces in another tool's "
                    "format. chakra: one MLCommons Chakra execution trace per rank, DIR/NAME.<rank>.et (a parameter "
                    "server's servers are further NPUs after the workers), for ASTRA-sim's "
                    "--workload-configuration=DIR/NAME; needs mlc-chakra (pip install --no-deps mlc-chakra "
                    "protobuf). perfetto: the measured and replayed timeline, DIR/NAME.json (ui.perfetto.dev).",
    )
    parser.add_argument("run", metavar="RUN", nargs="+", help="a run directory, or PyTorch profiler trace files")
    parser.add_argument("--format", dest="fmt", required=True, choices=("chakra", "perfetto"),
                        help="chakra (execution traces) or perfetto (timeline)")
    parser.add_argument("-o", "--output", metavar="DIR", required=True, help="the folder to write into")
    parser.add_argument("--name", default="dpro", help="the files' name prefix (default dpro)")
    parser.add_argument("--iterations", type=int, default=None,
                        help="steps of a run's graph to write (default: chakra 1, the mean step; perfetto 4); "
                             "profiler traces write every profiled step")
    parser.set_defaults(func=_cmd_export)


def _cmd_export(args: argparse.Namespace) -> int:
    from dpro.report.export import export_run, export_traces

    if len(args.run) == 1 and Path(args.run[0]).is_dir():
        written = export_run(args.run[0], args.output, args.fmt, name=args.name, iterations=args.iterations)
    else:
        written = export_traces([Path(p) for p in args.run], args.output, args.fmt, name=args.name)
    size = sum(p.stat().st_size for p in written)
    shown = ", ".join(p.name for p in written[:4]) + (f", ... ({len(written)} files)" if len(written) > 4 else "")
    print(f"{args.fmt}: {shown} written to {Path(args.output)} ({size / 1e6:.2f} MB)")
    return 0


def _write_config(path: Any, doc: dict[str, Any]) -> None:
    from dpro.config import Config, write_config

    write_config(path, Config.from_json(doc))


SUBCOMMANDS: tuple[Callable[[Any], None], ...] = (_add_info, _add_analyze, _add_whatif, _add_optimize,
                                                   _add_report, _add_compare, _add_export, _add_import_xplane)


def build_parser() -> argparse.ArgumentParser:
    """The ``dpro`` argument parser with every subcommand in ``SUBCOMMANDS``."""
    parser = argparse.ArgumentParser(
        prog="dpro",
        description="Profile distributed training, replay its step DAG, and apply a better configuration.",
    )
    parser.add_argument("--version", action="version", version=f"dpro {__version__}")
    parser.add_argument("-v", "--verbose", action="count", default=0, help="more diagnostics (debug)")
    parser.add_argument("-q", "--quiet", action="count", default=0, help="fewer diagnostics (-qq: errors only)")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for add in SUBCOMMANDS:
        add(subparsers)
    for sub in subparsers.choices.values():  # -v/-q after the subcommand too (dpro analyze RUN -v)
        sub.add_argument("-v", "--verbose", action="count", default=argparse.SUPPRESS, help="more diagnostics")
        sub.add_argument("-q", "--quiet", action="count", default=argparse.SUPPRESS, help="fewer diagnostics")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``dpro`` with ``argv`` (default ``sys.argv[1:]``); return the exit status.

    Raises:
        SystemExit: from argparse, for ``--help``, ``--version`` and wrong arguments.
    """
    args = build_parser().parse_args(argv)
    set_verbosity(args.verbose, args.quiet)
    try:
        return args.func(args)
    except (DproError, OSError) as err:
        return report_error("dpro", err, verbose=args.verbose > 0)


def report_error(program: str, err: BaseException, *, verbose: bool) -> int:
    """``<program>: error: <message>`` on stderr (the traceback before it with ``verbose``); ``EXIT_ERROR``."""
    if verbose:
        traceback.print_exception(err, file=sys.stderr)
    print(f"{program}: error: {err}", file=sys.stderr)
    return EXIT_ERROR
