"""The ``Engine`` interface: what the core asks of a communication engine (plain data and functions)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from dpro.config import Knob
    from dpro.io.kineto import KinetoTrace
    from dpro.io.load import Run
    from dpro.sim.choices import OptimizeResult
    from dpro.sim.whatif import Context, Prediction

__all__ = ["GENERIC", "Engine"]


def _no_groups(ctx: Context, knobs: dict[str, Any]) -> None:
    return None


def _nothing(run: Run) -> None:
    return None


def _no_prediction(ctx: Context, knobs: dict[str, Any]) -> None:
    return None


def _no_notes(run: Run) -> list[str]:
    return []


def _no_model(ctx: Context) -> None:
    return None


def _no_sweeps(ctx: Context) -> list[tuple[str, list[Any]]]:
    return []


def _no_files(doc: dict[str, Any]) -> dict[str, str]:
    return {}


def _server_queues(run: Run, args: dict[str, Any]) -> tuple[str, ...]:
    servers = args.get("servers")
    if not isinstance(servers, list):
        return ()
    return tuple(f"server{int(k)}" for k in servers if isinstance(k, int) and not isinstance(k, bool))


@dataclass(frozen=True)
class Engine:
    """One communication engine.

    Attributes:
        name: as written in run.json (``engine``) and in a config's fingerprint.
        doc: one line for tables and help.
        knobs: the engine's own knobs (``dpro.config.Knob``, with ``engine`` set).
        groups: ``(ctx, knobs) -> list of gradient-name groups or None``: how the engine would group the
            gradients into collectives under ``knobs`` (what-if); None when ``knobs`` change no grouping.
        optimize: ``(ctx, memory_budget_bytes=, allow_compression=) -> OptimizeResult``: the engine's search; None:
            only the searches every engine shares (``dpro.sim.choices.optimize_common``).
        prepare_run: ``(run) -> None``, after load (``dpro.engines.prepared``): complete the run from the engine's own
            traces.
        apply: how a config reaches the job, in words (for docs and tables).
        comm_knobs: the knobs that regroup the collectives (what-if rebuilds the communication for them).
        predict: ``(ctx, knobs) -> Prediction | None``: the engine's own prediction when ``knobs`` hold its knobs
            that no regrouping expresses (e.g. a background loop's cycle time); None: what-if's replay decides.
        transfer_calibration: ``"in-step"`` (from median launch and end times within the step, the default:
            right for engines that fuse differently from step to step and for collectives that run concurrently,
            as gloo's do) or ``"per-step"`` (a collective's transfer is the median of each step's transfer,
            collectives one after another); see ``dpro.dag.step_model.step_model``.
        chained_launch: each collective is launched only once the one before it has completed (TensorFlow's
            collectives are chained by ordering tokens); the DAG then makes each arrival wait for the previous
            transfer.
        transfer_queues: ``(run, COMM args) -> queue names``: the queues a collective's transfer occupies, one
            request after another (a parameter server's servers, ``args.servers``); empty: none (the default
            names ``server<k>`` for each of ``args.servers``).
        env_variables: the environment variables an applied config's ``env`` may set for a job of this engine
            (what its knobs are applied through); a config naming any other is refused, since a config is passed
            around and must not reach a job's environment with anything else (``LD_PRELOAD``, ``PYTHONPATH``).
        describe_model: ``(ctx) -> str | None``: the engine's own communication model in one line, for
            ``dpro whatif`` (None: the common fitted ``CommModel``).
        comm_after_backward: the gradients' collectives are launched only once the whole backward is done
            (Keras under MultiWorkerMirroredStrategy reduces the gradients after computing all of them), not as
            each one's gradients are ready; the DAG and what-if's regrouping then start them after the last BW.
        sweeps: ``(ctx) -> [(knob, values), ...]``: the engine's main knobs and the values a what-if curve of the
            step time plots (``dpro report``); empty: the engine has no knob of its own to plot.
        trace_whatif: ``(traces, info, graph, knobs) -> (graph, info, facts)``: the engine's grouping knobs on
            PyTorch profiler traces (``dpro.analyze.traces.whatif_traces``); None: the engine cannot regroup traces.
        trace_optimize: ``(traces, memory_budget_bytes, meta) -> {"candidates", "recommended", "config", ...}``:
            the engine's search on profiler traces (``dpro optimize TRACE...``; ``meta``: the run.json of a run
            directory recorded by the profiler, else None); None: none.
        launcher_files: ``(config document) -> {file name: text}``: files the engine's own launcher reads, made from
            an applied config and written beside it (Horovod: ``horovodrun.yaml`` for ``horovodrun --config-file``).
    """

    name: str
    doc: str
    knobs: tuple[Knob, ...] = ()
    groups: Callable[[Context, dict[str, Any]], list[list[str]] | None] = _no_groups
    optimize: Callable[..., OptimizeResult] | None = None
    prepare_run: Callable[[Run], None] = _nothing
    apply: str = ""
    comm_knobs: tuple[str, ...] = field(default=())  # knob names that regroup the collectives
    transfer_calibration: str = "in-step"  # how dag.step_model calibrates collective transfers
    notes: Callable[[Run], list[str]] = _no_notes  # what `dpro analyze` should say about a run of this engine
    predict: Callable[[Context, dict[str, Any]], Prediction | None] = _no_prediction  # the engine's own what-if
    chained_launch: bool = False  # a collective launches only after the previous one completed (dag.wiring)
    comm_after_backward: bool = False  # gradient collectives start after the whole backward (dag.wiring, whatif)
    transfer_queues: Callable[[Run, dict[str, Any]], tuple[str, ...]] = _server_queues  # (run, COMM args) -> queues
    describe_model: Callable[[Context], str | None] = _no_model  # (ctx) -> the engine's cost model in words
    env_variables: tuple[str, ...] = ()  # what a config's env may set (the variables the engine's knobs own)
    sweeps: Callable[[Context], list[tuple[str, list[Any]]]] = _no_sweeps  # (ctx) -> knobs and values to plot
    trace_whatif: Callable[..., Any] | None = None     # (traces, info, graph, knobs) -> (graph, info, facts)
    trace_optimize: Callable[[list[KinetoTrace], int | None, dict[str, Any] | None], dict[str, Any]] | None = None
    launcher_files: Callable[[dict[str, Any]], dict[str, str]] = _no_files  # (config) -> launcher's files beside it


    def knob_names(self) -> list[str]:
        return [k.name for k in self.knobs]


GENERIC = Engine(name="generic", doc="a job without an engine dpro models (one process, plain collectives)")
