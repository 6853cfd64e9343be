"""Small run directories written by hand in the documented format (docs/architecture.md "The run directory").

The JSON is spelled out here rather than produced by dpro's own writers, so the tests pin the format.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

QUEUE_TIDS = {"compute": 0, "comm": 1, "host": 2}
STEP_US = 9000.0


def x_event(name: str, cat: str, ts: float, dur: float, *, rank: int, queue: str, step: int,
            **args: Any) -> dict[str, Any]:
    """One Chrome "X" event as a dpro plugin writes it."""
    return {"name": name, "cat": cat, "ph": "X", "ts": ts, "dur": dur, "pid": rank,
            "tid": QUEUE_TIDS[queue], "args": {"step": step, **args}}


def step_events(rank: int, step: int) -> list[dict[str, Any]]:
    """One training step of a two-layer model: IO, FW, BW, two allreduce buckets, UPDATE, framed by STEP."""
    t0 = 1_000_000.0 + step * 10_000 + rank * 50
    ev = [
        x_event("STEP", "STEP", t0, STEP_US, rank=rank, queue="host", step=step),
        x_event("IO.batch", "IO", t0, 100.0, rank=rank, queue="host", step=step),
        x_event("FW.fc1", "FW", t0 + 100, 1000.0, rank=rank, queue="compute", step=step, bytes=2048),
        x_event("FW.fc2", "FW", t0 + 1100, 1000.0, rank=rank, queue="compute", step=step, bytes=1024),
        x_event("BW.fc2", "BW", t0 + 2100, 2000.0, rank=rank, queue="compute", step=step),
        x_event("COMM.bucket0.allreduce", "COMM", t0 + 4100, 1500.0, rank=rank, queue="comm", step=step,
                bytes=4096, tensors=["fc2.weight", "fc2.bias"], op="allreduce", phase="allreduce"),
        x_event("BW.fc1", "BW", t0 + 4100, 2000.0, rank=rank, queue="compute", step=step),
        x_event("COMM.bucket1.allreduce", "COMM", t0 + 6100, 1500.0, rank=rank, queue="comm", step=step,
                bytes=8192, tensors=["fc1.weight", "fc1.bias"], op="allreduce", phase="allreduce"),
        x_event("UPDATE.sgd", "UPDATE", t0 + 7600, 500.0, rank=rank, queue="compute", step=step),
    ]
    return ev


def rank_header(rank: int, host: str = "node-a") -> dict[str, Any]:
    return {"host": host, "pid": 4000 + rank, "clock": {"source": "CLOCK_MONOTONIC", "unit": "us"}}


def rank_doc(rank: int, world_size: int, steps: Iterable[int], *, complete: bool = True,
             note: str = "") -> dict[str, Any]:
    """The content of a finished ``rank-<r>.json``."""
    steps = list(steps)
    meta = [{"name": "process_name", "ph": "M", "pid": rank, "tid": 0, "args": {"name": f"rank {rank}"}}]
    meta += [{"name": "thread_name", "ph": "M", "pid": rank, "tid": tid, "args": {"name": queue}}
             for queue, tid in QUEUE_TIDS.items()]
    events = [e for s in steps for e in step_events(rank, s)]
    return {"schema": "dpro.trace/1", "dpro_version": "0.1.0", "rank": rank, "world_size": world_size,
            "complete": complete, "note": note, "steps": steps, **rank_header(rank),
            "displayTimeUnit": "ms", "traceEvents": meta + events}


def run_doc(world_size: int, steps: Iterable[int]) -> dict[str, Any]:
    return {"schema": "dpro.run/1", "framework": "torch", "engine": "torch-ddp", "world_size": world_size,
            "hosts": ["node-a"] * world_size, "profiled_steps": list(steps),
            "knobs": {"torch.ddp.bucket_cap_mb": 25.0, "backend": "gloo"},
            "model_fingerprint": "0123456789abcdef", "clocks": {"source": "CLOCK_MONOTONIC"},
            "versions": {"python": "3.11"}, "dpro_version": "0.1.0", "created": "2024-01-01T00:00:00+00:00"}


def model_doc() -> dict[str, Any]:
    grads = [("fc2.bias", 16, [4]), ("fc2.weight", 4080, [4, 255]), ("fc1.bias", 1020, [255]),
             ("fc1.weight", 7172, [255, 7])]
    return {
        "schema": "dpro.model/1",
        "gradients": [{"name": n, "bytes": b, "module": n.split(".")[0], "computed_by": n.split(".")[0],
                       "shape": shape, "dtype": "float32"} for n, b, shape in grads],
        "buckets": [{"index": 0, "bytes": 4096, "tensors": ["fc2.weight", "fc2.bias"]},
                    {"index": 1, "bytes": 8192, "tensors": ["fc1.weight", "fc1.bias"]}],
        "modules": [{"name": "<root>", "type": "Net", "parent": None, "param_bytes": 0,
                     "activation_bytes": None, "recorded": False},
                    {"name": "fc1", "type": "Linear", "parent": "<root>", "param_bytes": 8192,
                     "activation_bytes": 2048, "recorded": True},
                    {"name": "fc2", "type": "Linear", "parent": "<root>", "param_bytes": 4096,
                     "activation_bytes": 1024, "recorded": True}],
        "param_bytes": 12288,
    }


def write_json(path: Path, obj: Any) -> Path:
    path.write_text(json.dumps(obj))
    return path


def write_journal(path: Path, rank: int, world_size: int, steps: Iterable[int], *,
                  cut_step: int | None = None) -> Path:
    """A ``rank-<r>.partial.jsonl``; ``cut_step`` adds that step's line cut in half (died mid-write)."""
    lines = [json.dumps({"schema": "dpro.trace/1", "rank": rank, "world_size": world_size,
                         "header": rank_header(rank)})]
    lines += [json.dumps({"step": s, "events": step_events(rank, s)}) for s in steps]
    text = "\n".join(lines) + "\n"
    if cut_step is not None:
        broken = json.dumps({"step": cut_step, "events": step_events(rank, cut_step)})
        text += broken[: len(broken) // 2]
    path.write_text(text)
    return path


def write_rows_journal(path: Path, rank: int, world_size: int, steps: Iterable[int]) -> Path:
    """A ``rank-<r>.partial.jsonl`` as the recorder writes it: a header line, then one line per finished step whose
    events are compact rows ``[name, cat, tid, ts_ns, dur_ns, args]`` (a rank that died after its last step)."""
    lines = [json.dumps({"schema": "dpro.trace/1", "rank": rank, "world_size": world_size,
                         "header": rank_header(rank)})]
    for s in steps:
        rows = [[e["name"], e["cat"], e["tid"], round(e["ts"] * 1000), round(e["dur"] * 1000), e["args"]]
                for e in step_events(rank, s)]
        lines.append(json.dumps({"step": s, "rows": rows}))
    path.write_text("\n".join(lines) + "\n")
    return path


def make_run(root: Path, *, world_size: int = 2, steps: Iterable[int] = range(3, 8),
             ranks: Iterable[int] | None = None, meta: bool = True, model: bool = True) -> Path:
    """A run directory with finished traces for ``ranks`` (default: every rank)."""
    steps = list(steps)
    root.mkdir(parents=True, exist_ok=True)
    if meta:
        write_json(root / "run.json", run_doc(world_size, steps))
    if model:
        write_json(root / "model.json", model_doc())
    for rank in range(world_size) if ranks is None else ranks:
        write_json(root / f"rank-{rank}.json", rank_doc(rank, world_size, steps))
    return root


def make_run_of(root: Path, events_of: Callable[[int, int], list[dict[str, Any]]], *,
                steps: Iterable[int] = range(3, 8)) -> Path:
    """A 2-rank run directory whose ranks hold ``events_of(rank, step)`` for each step (run.json and model.json
    as ``make_run`` writes them)."""
    steps = list(steps)
    make_run(root, steps=steps)
    for rank in (0, 1):
        doc = rank_doc(rank, 2, steps)
        doc["traceEvents"] = [e for e in doc["traceEvents"] if e["ph"] == "M"]
        doc["traceEvents"] += [e for s in steps for e in events_of(rank, s)]
        write_json(root / f"rank-{rank}.json", doc)
    return root


# ---- a hand-written Horovod run: per-tensor COMM events and rank 0's timeline ---------------------------

HOROVOD_TIMELINE_FILE = "horovod-timeline.json"
OFFSET = 990_000.0   # rank 0's clock minus timeline time in the hand-written run
SHAPES = {"fc2.bias": "[4]", "fc2.weight": "[4, 255]", "fc1.bias": "[255]", "fc1.weight": "[1793]"}
BYTES = {"fc2.bias": 16, "fc2.weight": 4080, "fc1.bias": 1020, "fc1.weight": 7172}


def horovod_timeline_events(steps: list[int]) -> list[dict[str, Any]]:
    """Rank 0's timeline of a run whose steps each fuse (fc2.bias, fc2.weight) and (fc1.bias, fc1.weight)."""
    pids = {name: i + 1 for i, name in enumerate(["broadcast.fc2.bias", *(f"allreduce.{n}" for n in SHAPES)])}
    ev: list[dict[str, Any]] = [{"name": "process_name", "ph": "M", "pid": 0,
                                 "args": {"start_time_since_epoch_in_micros": 1_700_000_000_000_000}}]
    for name, pid in pids.items():
        ev.append({"name": "process_name", "ph": "M", "pid": pid, "args": {"name": name}})
    b = pids["broadcast.fc2.bias"]
    ev += [{"ph": "B", "name": "NEGOTIATE_BROADCAST", "ts": 100, "pid": b}, {"ph": "E", "ts": 110, "pid": b},
           {"ph": "B", "name": "BROADCAST", "ts": 120, "pid": b}, {"ph": "E", "ts": 130, "pid": b}]
    for step in steps:
        t0 = 1_000_000.0 + step * 10_000 - OFFSET
        for names, at in ((["fc2.bias", "fc2.weight"], 4120), (["fc1.bias", "fc1.weight"], 6120)):
            p = [pids[f"allreduce.{n}"] for n in names]
            for i, pid in enumerate(p):
                ev += [{"ph": "B", "name": "NEGOTIATE_ALLREDUCE", "ts": t0 + at + i, "pid": pid},
                       {"ph": "X", "name": "0", "ts": t0 + at + i, "pid": pid, "dur": 0}]
            ev += [{"ph": "E", "ts": t0 + at + 80, "pid": pid} for pid in p]
            ev += [{"ph": "B", "name": "ALLREDUCE", "ts": t0 + at + 90 + i, "pid": pid} for i, pid in enumerate(p)]
            for phase, start, end in (("MEMCPY_IN_FUSION_BUFFER", 100, 180), ("GLOO_ALLREDUCE", 180, 1280),
                                      ("MEMCPY_OUT_FUSION_BUFFER", 1280, 1370)):
                ev += [{"ph": "B", "name": phase, "ts": t0 + at + start, "pid": pid} for pid in p]
                ev += [{"ph": "E", "ts": t0 + at + end, "pid": pid} for pid in p]
            ev += [{"ph": "E", "ts": t0 + at + 1380, "pid": pid,
                    "args": {"dtype": "float32", "shape": SHAPES[n]}} for pid, n in zip(p, names, strict=True)]
    return ev


def horovod_timeline_text(events: list[dict[str, Any]]) -> str:
    """Horovod's layout: '[' then one event per line, comma-separated, closed by ']'."""
    return "[\n" + ",\n".join(json.dumps(e) for e in events) + "]"


def horovod_comm_events(rank: int, step: int) -> list[dict[str, Any]]:
    """What record_horovod writes: one COMM event per tensor, launch to completion."""
    t0 = 1_000_000.0 + step * 10_000 + rank * 50
    out = []
    for names, launch, done in ((["fc2.bias", "fc2.weight"], 4100, 5600), (["fc1.bias", "fc1.weight"], 6100, 7600)):
        for i, n in enumerate(names):
            out.append({"name": f"COMM.{n}.allreduce", "cat": "COMM", "ph": "X", "ts": t0 + launch + 10 * i,
                        "dur": done - launch - 10 * i, "pid": rank, "tid": 1,
                        "args": {"step": step, "bytes": BYTES[n], "tensors": [n], "op": "allreduce",
                                 "phase": "allreduce", "hvd_name": n}})
    return out


def make_horovod_run(root: Path, timeline: str | None, steps: tuple[int, ...] = (3, 4)) -> Path:
    make_run(root, steps=steps)
    meta = json.loads((root / "run.json").read_text())
    meta.update(engine="horovod", knobs={"HOROVOD_FUSION_THRESHOLD": 48 * 2**20, "HOROVOD_CYCLE_TIME": 5.0})
    (root / "run.json").write_text(json.dumps(meta))
    for rank in (0, 1):
        path = root / f"rank-{rank}.json"
        doc = json.loads(path.read_text())
        doc["traceEvents"] = [e for e in doc["traceEvents"] if e.get("cat") != "COMM"]
        doc["traceEvents"] += [e for s in steps for e in horovod_comm_events(rank, s)]
        path.write_text(json.dumps(doc))
    if timeline is not None:
        (root / HOROVOD_TIMELINE_FILE).write_text(timeline)
    return root


# ---- a hand-written tf-mwms run (MultiWorkerMirroredStrategy) ------------------------------------------------

MWMS_GRADS = [("fc1.kernel", 400_000), ("fc2.kernel", 400_000)]  # model variable order


def mwms_step_events(rank: int, step: int) -> list[dict]:
    t0 = 1_000_000.0 + step * 10_000 + rank * 50
    return [
        x_event("STEP", "STEP", t0, STEP_US, rank=rank, queue="host", step=step),
        x_event("FW.fc1", "FW", t0 + 100, 1000.0, rank=rank, queue="compute", step=step),
        x_event("FW.fc2", "FW", t0 + 1100, 1000.0, rank=rank, queue="compute", step=step),
        x_event("BW.fc2", "BW", t0 + 2100, 1000.0, rank=rank, queue="compute", step=step,
                grads=["fc2.kernel"], grads_ready_us=[t0 + 3100]),
        x_event("BW.fc1", "BW", t0 + 3100, 2000.0, rank=rank, queue="compute", step=step,
                grads=["fc1.kernel"], grads_ready_us=[t0 + 5100]),
        x_event("COMM.pack0.allreduce", "COMM", t0 + 5150, 2000.0, rank=rank, queue="comm", step=step,
                bytes=800_000, tensors=["fc2.kernel", "fc1.kernel"], op="allreduce", phase="allreduce"),
        x_event("UPDATE.optimizer", "UPDATE", t0 + 7200, 300.0, rank=rank, queue="compute", step=step),
        x_event("COMM.loss.allreduce", "COMM", t0 + 7200, 1500.0, rank=rank, queue="comm", step=step,
                bytes=4, tensors=[], op="allreduce", phase="allreduce"),
    ]


def make_mwms_run(root: Path) -> Path:
    """A 2-rank tf-mwms run: the gradients' one pack after the whole backward, then the loss's reduction."""
    make_run_of(root, mwms_step_events)
    meta = json.loads((root / "run.json").read_text())
    meta.update(framework="tf", engine="tf-mwms", knobs={"tf.mwms.bytes_per_pack": 0})
    write_json(root / "run.json", meta)
    model = json.loads((root / "model.json").read_text())
    model["gradients"] = [{"name": n, "bytes": b, "module": n.split(".")[0], "computed_by": n.split(".")[0],
                           "shape": [b // 4], "dtype": "float32"} for n, b in MWMS_GRADS]
    model["buckets"] = [{"index": 0, "bytes": 800_000, "tensors": ["fc2.kernel", "fc1.kernel"]}]
    write_json(root / "model.json", model)
    return root


# ---- a wide run: many layers on many ranks (report size, big-page tests and benches) ----------------------

def wide_step_events(rank: int, step: int, layers: int, per_bucket: int) -> list[dict[str, Any]]:
    """One step of a ``layers``-deep model: IO, a FW and a BW per layer, one allreduce per ``per_bucket`` layers'
    gradients launched as their backward ends, UPDATE; ranks skewed a little so that stragglers show."""
    fw, bw = 20.0, 40.0
    t0 = 1_000_000.0 + step * (layers * 100.0 + 20_000) + rank * 7
    ev = [x_event("IO.batch", "IO", t0, 100.0, rank=rank, queue="host", step=step)]
    t = t0 + 100
    for i in range(layers):
        ev.append(x_event(f"FW.layer{i}", "FW", t, fw + (i % 7) + rank, rank=rank, queue="compute", step=step,
                          bytes=4096))
        t += fw + (i % 7) + rank
    comm_free = t
    for k, i in enumerate(reversed(range(layers))):
        ev.append(x_event(f"BW.layer{i}", "BW", t, bw, rank=rank, queue="compute", step=step))
        t += bw
        if (k + 1) % per_bucket == 0 or i == 0:
            b = k // per_bucket
            names = [f"layer{j}.weight" for j in range(i, min(layers, i + per_bucket))]
            start = max(t, comm_free)
            ev.append(x_event(f"COMM.bucket{b}.allreduce", "COMM", start, 300.0, rank=rank, queue="comm",
                              step=step, bytes=4096 * len(names), tensors=names, op="allreduce", phase="allreduce"))
            comm_free = start + 300.0
    end = max(t, comm_free)
    ev.append(x_event("UPDATE.sgd", "UPDATE", end, 200.0, rank=rank, queue="compute", step=step))
    ev.insert(0, x_event("STEP", "STEP", t0, end + 200.0 - t0, rank=rank, queue="host", step=step))
    return ev


def make_wide_run(root: Path, *, world_size: int = 8, layers: int = 500, per_bucket: int = 25,
                  steps: Iterable[int] = range(3, 6)) -> Path:
    """A run directory of ``world_size`` ranks, each step holding ~2 x ``layers`` ops (plus allreduces)."""
    steps = list(steps)
    root.mkdir(parents=True, exist_ok=True)
    write_json(root / "run.json", run_doc(world_size, steps))
    grads = [{"name": f"layer{i}.weight", "bytes": 4096, "module": f"layer{i}", "computed_by": f"layer{i}",
              "shape": [1024], "dtype": "float32"} for i in reversed(range(layers))]
    buckets, k = [], 0
    for start in range(0, layers, per_bucket):
        hi = layers - start
        names = [f"layer{j}.weight" for j in range(max(0, hi - per_bucket), hi)]
        buckets.append({"index": k, "bytes": 4096 * len(names), "tensors": names})
        k += 1
    modules = [{"name": "<root>", "type": "Net", "parent": None, "param_bytes": 0, "activation_bytes": None,
                "recorded": False}]
    modules += [{"name": f"layer{i}", "type": "Linear", "parent": "<root>", "param_bytes": 4096,
                 "activation_bytes": 4096, "recorded": True} for i in range(layers)]
    write_json(root / "model.json", {"schema": "dpro.model/1", "gradients": grads, "buckets": buckets,
                                     "modules": modules, "param_bytes": 4096 * layers})
    for rank in range(world_size):
        doc = rank_doc(rank, world_size, steps)
        doc["traceEvents"] = [e for e in doc["traceEvents"] if e["ph"] == "M"]
        doc["traceEvents"] += [e for s in steps for e in wide_step_events(rank, s, layers, per_bucket)]
        write_json(root / f"rank-{rank}.json", doc)
    return root
