"""dpro export: Chakra execution traces read back with Chakra's own reader (nodes, dependencies, sizes, and the
replayed step against dpro's replay) for every engine's runs and for PyTorch profiler traces; Perfetto timelines
whose slices nest on every track."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from et_replay import attrs_of, replay_et
from jobrunner import torchrun
from run_builder import horovod_timeline_events, horovod_timeline_text, make_horovod_run, make_mwms_run, make_run

from dpro.analyze import analyze_run
from dpro.cli import main
from dpro.dag.kineto import graph_from_kineto
from dpro.dag.wiring import graph_from_steps
from dpro.errors import UsageError
from dpro.io.kineto import load_traces
from dpro.io.load import load_run
from dpro.report import chakra
from dpro.report.chakra import comm_info_of_model, read_chakra
from dpro.report.perfetto import nest_tracks, nesting_problems
from dpro.sim.replay import replay

needs_chakra = pytest.mark.skipif(chakra._pb is None, reason="mlc-chakra is not installed (make venv installs it)")

DATA = Path(__file__).parent.parent / "data"
KINETO = DATA / "kineto" / "ddp2_rank0_nccl.json.gz"
COLL, SEND, RECV = 7, 5, 6  # Chakra's NodeType values


def _runs(tmp_path: Path) -> dict[str, Path]:
    mxnet = tmp_path / "mxnet"
    shutil.copytree(DATA / "mxnet" / "mlp-2workers-2servers", mxnet)
    return {"torch-ddp": make_run(tmp_path / "ddp"),
            "horovod": make_horovod_run(tmp_path / "hvd", horovod_timeline_text(horovod_timeline_events([3, 4]))),
            "tf-mwms": make_mwms_run(tmp_path / "mwms"), "mxnet-ps": mxnet}


def _read(paths: list[Path]) -> dict[int, list]:
    files = {}
    for p in paths:
        meta, nodes = read_chakra(p)
        assert {a.name for a in meta.attr} >= {"schema", "producer", "npus"}
        files[int(p.name.split(".")[-2])] = nodes
    return files


def _check_structure(files: dict[int, list]) -> None:
    """Every dependency names an earlier node of its file (so the graph is acyclic); every send has its receive."""
    messages: dict[tuple, list[int]] = {}
    for npu, nodes in files.items():
        assert [n.id for n in nodes] == list(range(len(nodes))), npu
        for n in nodes:
            assert all(d < n.id for d in n.data_deps), (npu, n.name, list(n.data_deps))
            assert not n.ctrl_deps
            a = attrs_of(n)
            assert "is_cpu_op" in a
            if n.type == COLL:
                assert {"comm_type", "comm_size"} <= set(a), n.name
            if n.type in (SEND, RECV):
                assert (a["comm_src"] == npu) == (n.type == SEND) and (a["comm_dst"] == npu) == (n.type == RECV)
                key = (a["comm_src"], a["comm_dst"], a["comm_tag"])
                messages.setdefault(key, []).append(a["comm_size"])
    assert all(len(sizes) == 2 and sizes[0] == sizes[1] for sizes in messages.values()), messages


@needs_chakra
@pytest.mark.parametrize("engine", ["torch-ddp", "horovod", "tf-mwms", "mxnet-ps"])
def test_chakra_export_of_every_engine_reads_back_and_replays_to_dpros_step(tmp_path, engine, capsys):
    run_dir = _runs(tmp_path)[engine]
    out = tmp_path / "et"
    assert main(["export", str(run_dir), "--format", "chakra", "-o", str(out), "--iterations", "2"]) == 0
    assert "chakra:" in capsys.readouterr().out
    result = analyze_run(load_run(run_dir))
    comms = comm_info_of_model(result.model)
    servers = {s for c in comms.values() for s in c.servers}
    paths = sorted(out.glob("dpro.*.et"))
    assert len(paths) == 2 + len(servers)  # a file per worker rank, and per parameter server
    files = _read(paths)
    _check_structure(files)
    for npu in (0, 1):
        colls = [n for n in files[npu] if n.type == COLL]
        sends = [n for n in files[npu] if n.type == SEND]
        if servers:  # every push_pull is a send of each part to its server and a receive of the answer
            assert not colls and sends
            pushed = sum(attrs_of(n)["comm_size"] for n in sends) // 2  # two iterations
            assert pushed == sum(c.nbytes for c in comms.values())
        else:
            assert sorted({(n.name, attrs_of(n)["comm_size"]) for n in colls}) == sorted(
                (name, c.nbytes) for name, c in comms.items())
            assert all(attrs_of(n)["comm_type"] == 0 for n in colls)  # ALL_REDUCE
    # the ET replayed (collectives across ranks, messages with their peers) ends each step where dpro's replay does
    g = graph_from_steps(result.model, 2)
    sched = replay(g)
    ends = replay_et(files)
    for (rank, it), node in g.step_end.items():
        (et,) = [n for n in files[rank] if n.name == "STEP.end" and attrs_of(n)["dpro_iteration"] == it]
        assert abs(ends[rank][et.id] - sched.end[node]) <= 2.0 + 1e-4 * sched.end[node], (rank, it)


@needs_chakra
def test_chakra_export_of_profiler_traces(tmp_path):
    out = tmp_path / "et"
    assert main(["export", str(KINETO), "--format", "chakra", "-o", str(out), "--name", "nccl"]) == 0
    files = _read(sorted(out.glob("nccl.*.et")))
    assert list(files) == [0]
    _check_structure(files)
    traces = load_traces([KINETO])
    g, info = graph_from_kineto(traces)
    gaps = sum(g.category[n] == "NCCL" and g.gap[n] >= 0.5 for n in range(g.size))
    assert len(files[0]) == sum(g.rank >= 0) + gaps  # a node per op, and one per gap before a collective's launch
    colls = [n for n in files[0] if n.type == COLL]
    assert [attrs_of(n)["comm_size"] for n in colls] == [c.bytes for c in traces[0].collectives()]
    assert {attrs_of(n)["comm_type"] for n in colls} == {0, 5}  # ALL_REDUCE, BROADCAST
    host_ops = sum("/host" in g.queue_names[q] for q in g.queue if q >= 0)
    assert sum(attrs_of(n)["is_cpu_op"] for n in files[0]) == host_ops + gaps
    sched = replay(g)
    ends = replay_et(files)
    for (_, it), node in g.step_end.items():
        (et,) = [n for n in files[0] if n.name == g.names[node] and attrs_of(n)["dpro_iteration"] == it]
        assert abs(ends[0][et.id] - sched.end[node]) <= 1e-3 * sched.end[node], it  # µs rounding of 2,700 ops


def test_without_chakra_the_export_says_how_to_install_it(tmp_path, monkeypatch):
    monkeypatch.setattr(chakra, "_pb", None)
    with pytest.raises(UsageError, match=r"pip install --no-deps mlc-chakra protobuf"):
        chakra.write_chakra(tmp_path, "x", {})
    code = ("import sys; sys.modules['chakra'] = None\n"
            "import dpro.report.chakra, dpro.report.export, dpro.cli\n"
            "from dpro.cli import main\n"
            f"sys.exit(main(['export', {str(make_run(tmp_path / 'run'))!r}, '--format', 'chakra', '-o', "
            f"{str(tmp_path / 'et')!r}]))\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "pip install --no-deps mlc-chakra protobuf" in proc.stderr, proc.stderr


def test_a_bad_name_or_format_is_refused(tmp_path):
    from dpro.report.export import export_run

    run_dir = make_run(tmp_path / "run")
    with pytest.raises(UsageError, match="--name"):
        export_run(run_dir, tmp_path / "et", "chakra", name="../x")
    with pytest.raises(UsageError, match="--format 'xml'"):
        export_run(run_dir, tmp_path / "et", "xml")


# ---- Perfetto: slices nest on every track ----------------------------------------------------------------


def test_overlapping_slices_go_to_tracks_of_their_own():
    meta = [{"name": "thread_name", "ph": "M", "pid": 0, "tid": 1, "args": {"name": "comm"}}]
    x = [{"name": n, "ph": "X", "pid": 0, "tid": 1, "ts": ts, "dur": dur, "cat": "COMM", "args": {}}
         for n, ts, dur in [("a", 0.0, 10.0), ("b", 5.0, 10.0), ("c", 6.0, 2.0), ("d", 20.0, 1.0),
                            ("e", 0.0, 10.0)]]
    problems = nesting_problems(meta + x)
    assert len(problems) == 1 and "'b'" in problems[0] and "inside 'e'" in problems[0]
    fixed = nest_tracks(meta + x)
    assert nesting_problems(fixed) == []
    slices = {e["name"]: e for e in fixed if e["ph"] == "X"}
    assert {k: (v["ts"], v["dur"]) for k, v in slices.items()} == {e["name"]: (e["ts"], e["dur"]) for e in x}
    assert slices["a"]["tid"] == slices["e"]["tid"] == slices["d"]["tid"] == 1  # nested or apart: the same track
    assert slices["b"]["tid"] != 1 and slices["c"]["tid"] == 1  # c nests in a (and e): it stays
    names = {e["tid"]: e["args"]["name"] for e in fixed if e["ph"] == "M"}
    assert names[slices["b"]["tid"]] == "comm (2)"


def test_perfetto_export_of_the_shared_kineto_trace_nests(tmp_path):
    out = tmp_path / "pf"
    assert main(["export", str(KINETO), "--format", "perfetto", "-o", str(out)]) == 0
    events = json.loads((out / "dpro.json").read_text())["traceEvents"]
    assert sum(e["ph"] == "X" for e in events) > 1000 and nesting_problems(events) == []


@needs_chakra
@pytest.mark.slow
def test_real_runs_timelines_nest_and_their_traces_export(tmp_path):
    """A 2-rank gloo DDP job recorded by dpro, and one profiled by torch.profiler: replay.json and the exported
    timelines nest on every track, and the profiler traces' Chakra export carries gloo's all_reduce sizes."""
    run_dir = tmp_path / "run"
    torchrun("ddp_job.py", "--model", "mlp", "--steps", "8", "--profile", "2:7", "--run-dir", str(run_dir),
             "--bucket-cap-mb", "0.25")
    assert main(["analyze", str(run_dir)]) == 0
    events = json.loads((run_dir / "analysis" / "replay.json").read_text())["traceEvents"]
    assert {e["pid"] for e in events if e["ph"] == "X"} >= {0, 1, 1000, 1001}
    assert nesting_problems(events) == []
    assert main(["export", str(run_dir), "--format", "perfetto", "-o", str(tmp_path / "pf")]) == 0
    assert nesting_problems(json.loads((tmp_path / "pf" / "dpro.json").read_text())["traceEvents"]) == []
    assert main(["export", str(run_dir), "--format", "chakra", "-o", str(tmp_path / "et")]) == 0
    _check_structure(_read(sorted((tmp_path / "et").glob("dpro.*.et"))))

    traces = tmp_path / "traces"
    traces.mkdir()
    torchrun("profiled_gloo_ddp.py", "--out", str(traces), "--record-shapes")
    paths = sorted(traces.glob("rank*.pt.trace.json"))
    assert main(["export", *map(str, paths), "--format", "perfetto", "-o", str(tmp_path / "kpf")]) == 0
    assert nesting_problems(json.loads((tmp_path / "kpf" / "dpro.json").read_text())["traceEvents"]) == []
    assert main(["export", *map(str, paths), "--format", "chakra", "-o", str(tmp_path / "ket")]) == 0
    files = _read(sorted((tmp_path / "ket").glob("dpro.*.et")))
    _check_structure(files)
    for npu, nodes in files.items():
        colls = [attrs_of(n) for n in nodes if n.type == COLL]
        assert colls and all(c["comm_type"] == 0 and c["comm_size"] > 0 for c in colls), npu
        # every gradient byte of the job's MLP (512-1024-1024-10, float32) in one all_reduce a step, 5 steps
        assert sum(c["comm_size"] for c in colls) == 5 * 4 * (512 * 1024 + 1024 + 1024 * 1024 + 1024 + 1024 * 10 + 10)


@pytest.mark.parametrize("op, kind", [("allreduce", "ALL_REDUCE"), ("all_reduce", "ALL_REDUCE"),
                                      ("_reduce_scatter_base", "REDUCE_SCATTER"), ("reduce", "REDUCE"),
                                      ("_allgather_base", "ALL_GATHER"), ("broadcast", "BROADCAST"),
                                      ("alltoall_base", "ALL_TO_ALL"), ("push_pull", "ALL_REDUCE")])
def test_collective_names_map_to_chakras_types(op, kind):
    assert chakra.comm_type(op) == kind


@needs_chakra
def test_reading_a_missing_trace_is_refused(tmp_path):
    with pytest.raises(UsageError, match="no such Chakra execution trace"):
        read_chakra(tmp_path / "x.0.et")
