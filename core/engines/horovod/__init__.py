"""The ``horovod`` engine: Horovod's ``DistributedOptimizer`` (PyTorch), allreduces fused by Horovod's background
loop. Its traces: ``timeline`` (HOROVOD_TIMELINE, merged into the loaded run by ``dpro.engines.prepared``: each
tensor's COMM ends with its fused buffer); its search: ``search`` (fusion threshold, cycle time and response cache
by a simulation of the loop, written as the config's ``env`` knobs)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from dpro.config import Knob, _count, _number
from dpro.engines.base import Engine
from dpro.engines.horovod.knobs import (
    CACHE,
    CYCLE,
    DEFAULT_CYCLE_TIME_MS,
    DEFAULT_FUSION_THRESHOLD,
    NAME,
    THRESHOLD,
    knobs_from_environment,
    knobs_set_by,
)
from dpro.engines.horovod.search import HVD_THRESHOLDS_MB, horovod_predict, knobs_in_force, search
from dpro.engines.horovod.timeline import find_timeline, merge_horovod_timeline
from dpro.sim.whatif import Prediction, predict

if TYPE_CHECKING:
    from dpro.io.load import Run
    from dpro.sim.whatif import Context

__all__ = ["CACHE", "CONFIG_FILE_NAME", "CYCLE", "DEFAULT_CYCLE_TIME_MS", "DEFAULT_FUSION_THRESHOLD", "ENGINE", "NAME",
           "THRESHOLD", "horovodrun_config", "knobs_from_environment"]

def _prepare_run(run: Run) -> None:
    """Merge ``horovod-timeline.json`` (fused buffers) into the run when it holds one."""
    path = find_timeline(run)
    if path is None:
        return
    merged = merge_horovod_timeline(run, path) or {}
    if merged.get("steps_without_timeline"):
        # Horovod's timeline slows the steps it runs in; the step model uses the others while enough remain
        run.set_aside.update({step: "ran with Horovod's timeline" for step in merged.get("steps", [])})


CONFIG_FILE_NAME = "horovodrun.yaml"


def horovodrun_config(doc: dict[str, Any]) -> str:
    """An applied config's Horovod settings as the YAML ``horovodrun --config-file`` reads (its ``params`` section:
    ``fusion_threshold_mb``, ``cycle_time_ms``, ``cache_capacity``; horovod/runner/common/util/config_parser.py),
    which ``dpro-launch --config-file`` reads too."""
    env = (doc.get("knobs") or {}).get("env") or {}
    lines = ["# written by dpro optimize: the Horovod settings of the config beside it, for",
             "#   horovodrun --config-file horovodrun.yaml ...   or   dpro-launch --config-file horovodrun.yaml ...",
             "# (a flag on the command line wins over this file)", "params:"]
    if THRESHOLD in env:
        mb = int(env[THRESHOLD]) / 2**20
        lines.append(f"  fusion_threshold_mb: {int(mb) if mb.is_integer() else mb!r}")
    if CYCLE in env:
        cycle = float(env[CYCLE])
        lines.append(f"  cycle_time_ms: {int(cycle) if cycle.is_integer() else cycle!r}")
    if CACHE in env:
        lines.append(f"  cache_capacity: {int(env[CACHE])}")
    return "\n".join(lines) + "\n"


def _notes(run: Run) -> list[str]:
    merged = ((run.meta or {}).get("horovod") or {}).get("merged") or {}
    notes = []
    if merged.get("steps_without_timeline"):
        aside = "; the step model is built from the others (when there are enough)" if run.set_aside else ""
        notes.append(f"Horovod's timeline ran in {len(merged.get('steps', []))} of the recorded steps, which it slows"
                     f"{aside}: the other {len(merged['steps_without_timeline'])} time each allreduce from its launch "
                     "to the completion the recorder saw, and the fused buffers that price Horovod's knobs come from "
                     "the steps with the timeline")
    if merged.get("distinct_fusions", 0) > 1:
        notes.append(f"Horovod fused the gradients {merged['distinct_fusions']} different ways in "
                     f"{len(merged.get('steps', []))} steps (fusion depends on timing); every step is used: each "
                     "tensor's allreduce ends with its fused buffer, and transfers are calibrated from mean end "
                     "times in the step")
    return notes


def _bytes(value: Any, source: str, key: str) -> int:
    return _count(value, source, key)


def _cycle_ms(value: Any, source: str, key: str) -> float:
    return _number(value, source, key, positive=True, what="a positive number of milliseconds")


def _predict(ctx: Context, knobs: dict[str, Any]) -> Prediction | None:
    """What-if of Horovod's own knobs: the loop model's difference from the setting in force, added to the replay
    (as the search prices them), also where a config's ``env`` section sets them; other knobs are left to what-if's
    replay."""
    knobs = {**{k: v for k, v in knobs.items() if k != "env"}, **knobs_set_by(knobs.get("env") or {})}
    if not any(k in knobs for k in (THRESHOLD, CYCLE, CACHE)):
        return None

    others = {k: v for k, v in knobs.items() if k not in (THRESHOLD, CYCLE, CACHE)}
    base = predict(ctx, others)
    threshold0, cycle0, cache0 = knobs_in_force(ctx)
    step_ms = horovod_predict(ctx, float(knobs.get(THRESHOLD, threshold0)), float(knobs.get(CYCLE, cycle0)),
                              int(knobs.get(CACHE, cache0)))
    same = horovod_predict(ctx, threshold0, cycle0, cache0)
    return Prediction(knobs=dict(knobs), predicted_step_ms=base.predicted_step_ms + step_ms - same,
                          predicted_peak_memory_bytes=base.predicted_peak_memory_bytes, graph_nodes=base.graph_nodes,
                          per_rank_ms={})


def _sweeps(ctx: Context) -> list[tuple[str, list[Any]]]:
    """The fusion threshold over the thresholds the search tries and the one in force (``dpro report``'s curves)."""
    threshold = int(knobs_in_force(ctx)[0])
    return [(THRESHOLD, sorted({*(int(mb * 2**20) for mb in HVD_THRESHOLDS_MB), threshold}))]


ENGINE = Engine(
    name=NAME,
    doc="Horovod (PyTorch, Gloo/MPI): tensors fused by Horovod's background loop, one allreduce per buffer",
    optimize=search,
    knobs=(
        Knob(THRESHOLD, "Horovod's fusion buffer in bytes (0: no fusion); applied through the config's env",
             _bytes, default=128 * 2**20, config=False, engine=NAME),
        Knob(CYCLE, "Horovod's background cycle in ms; applied through the config's env", _cycle_ms, default=1.0,
             config=False, engine=NAME),
        Knob(CACHE, "Horovod's response cache entries (0: off); applied through the config's env", _bytes,
             default=1024, config=False, engine=NAME),
    ),
    predict=_predict,
    prepare_run=_prepare_run,
    env_variables=(THRESHOLD, CYCLE, CACHE),
    notes=_notes,
    sweeps=_sweeps,
    launcher_files=lambda doc: {CONFIG_FILE_NAME: horovodrun_config(doc)},
    apply="environment (HOROVOD_FUSION_THRESHOLD, HOROVOD_CYCLE_TIME) set by dpro-launch --apply; tensor_groups as "
          "hvd.DistributedOptimizer(groups=) by dpro-launch's auto-attach",
)
