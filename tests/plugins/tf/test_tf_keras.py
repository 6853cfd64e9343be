"""The TensorFlow plugin: XPlane reading, op mapping, and real MultiWorkerMirroredStrategy jobs."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from jobrunner import JOBS, job_env, rerun_if_killed_in_framework

pytest.importorskip("tensorflow")

from dpro.errors import TraceError, UsageError  # noqa: E402
from dpro.plugins.tf.ops import Layout, Pack, classify, pack_gradients, step_rows  # noqa: E402
from dpro.plugins.tf.transport import tf_config  # noqa: E402
from dpro.plugins.tf.xplane import Collective, HostOp, read_xplane  # noqa: E402

WEIGHTED = ("conv1", "bn1", "fc1", "fc2")


# ---- pure functions ------------------------------------------------------------------------------

def test_packs_follow_mwms_rule() -> None:
    grads = [("a", 100), ("b", 10), ("c", 50), ("d", 50)]
    assert pack_gradients(grads, 0) == [Pack(("d", "c", "b", "a"), 210)]
    # reversed, a new pack once the current holds more than 60 bytes
    assert pack_gradients(grads, 60) == [Pack(("d", "c"), 100), Pack(("b", "a"), 110)]


def _op(name: str, start_us: float, dur_us: float, kind: str = "K") -> HostOp:
    return HostOp(name=name, type=kind, start_ns=int(start_us * 1000), dur_ns=int(dur_us * 1000), thread="tf_Compute/1")


def test_ops_map_to_layers_and_packing_joins_the_collective() -> None:
    layout = Layout(layers=frozenset({"conv1", "fc1"}), grads_of={"conv1": ("conv1.kernel",), "fc1": ("fc1.kernel",)},
                    optimizer_scopes=frozenset({"SGD"}), packs=(Pack(("fc1.kernel", "conv1.kernel"), 400),))
    assert classify(_op("model/conv1/Conv2D", 0, 1), layout) == ("FW", "FW.conv1")
    assert classify(_op("gradient_tape/model/fc1/MatMul", 0, 1), layout) == ("BW", "BW.fc1")
    assert classify(_op("SGD/update/mul", 0, 1), layout) == ("UPDATE", "UPDATE.optimizer")
    ops = [_op("Cast", 0, 2), _op("model/conv1/Conv2D", 3, 10), _op("model/conv1/Relu", 13.5, 1),
           _op("model/fc1/MatMul", 15, 5), _op("loss/Sum", 21, 1), _op("gradient_tape/loss/Mul", 23, 1),
           _op("gradient_tape/model/fc1/MatMul", 25, 4), _op("gradient_tape/model/conv1/Conv2DBackprop", 30, 6),
           _op("concat", 37, 3, "ConcatV2"), _op("model/fc1/MatMul/ReadVariableOp", 38, 1, "ReadVariableOp"),
           _op("split", 90, 2, "SplitV"), _op("SGD/update/sub", 93, 1)]
    colls = [Collective("CollectiveReduceV2", 41_000, 88_000, 45_000, 87_000, 7),
             Collective("div_no_nan/CollectiveReduceV2", 95_000, 99_000, None, None, None)]
    rows = step_rows(ops, colls, step=3, layout=layout, wall_minus_mono_ns=0)
    names = [r[0] for r in rows]
    assert names == ["IO.input", "FW.conv1", "FW.fc1", "FW.loss", "BW.loss", "BW.fc1", "BW.conv1",
                     "COMM.pack0.allreduce", "UPDATE.step", "UPDATE.optimizer",
                     "COMM.div_no_nan_CollectiveReduceV2.allreduce"]
    by_name = {r[0]: r for r in rows}
    assert by_name["FW.conv1"][5]["ops"] == 2                       # Conv2D and Relu, 0.5 µs apart: one event
    pack = by_name["COMM.pack0.allreduce"]
    assert pack[3] == 37_000 and pack[4] == 51_000                 # ns: starts with the concat, ends when done
    assert pack[5]["bytes"] == 400 and pack[5]["tensors"] == ["fc1.kernel", "conv1.kernel"]
    assert by_name["BW.conv1"][5]["grads"] == ["conv1.kernel"]
    assert by_name["BW.conv1"][5]["grads_ready_us"] == [36.0]
    assert by_name["COMM.div_no_nan_CollectiveReduceV2.allreduce"][5]["tensors"] == []
    assert all(r[5]["step"] == 3 for r in rows)


def test_nested_layers_are_named_by_path_and_a_forward_outside_the_model_is_recomputation() -> None:
    layout = Layout(layers=frozenset({"block1", "fc", "head"}), paths={"block1": "block1", "fc": "block1.fc",
                                                                      "head": "head"}, root="net")
    assert classify(_op("net/block1/fc/MatMul", 0, 1), layout) == ("FW", "FW.block1.fc")
    assert classify(_op("StatefulPartitionedCall/net_1/block1_1/fc_1/MatMul", 0, 1), layout) == ("FW", "FW.block1.fc")
    assert classify(_op("gradient_tape/fc/MatMul_1", 0, 1), layout) == ("BW", "BW.block1.fc")
    # tf.recompute_grad / keras.remat run the block's forward again, in the backward, outside the model's scope
    assert classify(_op("fc/MatMul", 0, 1), layout) == ("RECOMPUTE", "RECOMPUTE.block1.fc")
    assert classify(_op("net/head/MatMul", 0, 1), layout) == ("FW", "FW.head")
    ops = [_op("net/block1/fc/MatMul", 0, 5), _op("net/head/MatMul", 6, 2), _op("gradient_tape/head/MatMul", 9, 2),
           _op("fc/MatMul", 12, 5), _op("gradient_tape/fc/MatMul_1", 18, 4)]
    names = [r[0] for r in step_rows(ops, [], step=0, layout=layout, wall_minus_mono_ns=0)]
    assert names == ["FW.block1.fc", "FW.head", "BW.head", "RECOMPUTE.block1.fc", "BW.block1.fc"]


def _op_on(name: str, start_us: float, dur_us: float, thread: str, kind: str = "K") -> HostOp:
    return HostOp(name=name, type=kind, start_ns=int(start_us * 1000), dur_ns=int(dur_us * 1000), thread=thread)


def test_every_step_has_the_same_events_however_the_executor_ordered_its_ops() -> None:
    """fc1's backward is interleaved with conv1's in one step and not in the other; a metric op runs on a second
    inter-op thread beside conv1's backward. Both steps give one event per name, the concurrent time counted once,
    and the events' busy and idle time add up to the step's span."""
    layout = Layout(layers=frozenset({"conv1", "fc1"}), grads_of={"conv1": ("conv1.kernel",), "fc1": ("fc1.kernel",)},
                    optimizer_scopes=frozenset({"SGD"}), packs=(Pack(("fc1.kernel", "conv1.kernel"), 400),))
    colls = [Collective("CollectiveReduceV2", 60_000, 80_000, 61_000, 79_000, 7)]
    t1, t2 = "tf_Compute/1", "tf_Compute/2"
    plain = [_op_on("model/conv1/Conv2D", 0, 10, t1), _op_on("model/fc1/MatMul", 10, 5, t1),
             _op_on("gradient_tape/model/fc1/MatMul", 20, 4, t1),
             _op_on("gradient_tape/model/fc1/BiasAddGrad", 24, 1, t1),
             _op_on("gradient_tape/model/conv1/Conv2DBackprop", 25, 20, t1), _op_on("SGD/update/sub", 81, 2, t1)]
    shuffled = [_op_on("model/conv1/Conv2D", 0, 10, t1), _op_on("model/fc1/MatMul", 10, 5, t1),
                _op_on("gradient_tape/model/fc1/MatMul", 20, 4, t1),
                _op_on("gradient_tape/model/conv1/Conv2DBackprop", 24, 20, t1),
                _op_on("gradient_tape/model/fc1/BiasAddGrad", 44, 1, t1),
                _op_on("AssignAddVariableOp", 30, 10, t2, "AssignAddVariableOp"), _op_on("SGD/update/sub", 81, 2, t1)]
    first = step_rows(plain, colls, step=1, layout=layout, wall_minus_mono_ns=0)
    second = step_rows(shuffled, colls, step=2, layout=layout, wall_minus_mono_ns=0)
    compute = [r for r in second if r[1] in ("FW", "BW")]
    assert [r[0] for r in first if r[1] in ("FW", "BW")] == [r[0] for r in compute]
    by_name = {r[0]: r for r in second}
    assert by_name["BW.fc1"][5]["ops"] == 2 and by_name["BW.fc1"][4] == 5_000             # ns: 4 + 1 µs
    # conv1's backward shares [30, 40) with the metric op: 20 µs of its own time less half of those 10 µs
    assert by_name["BW.conv1"][4] == 15_000 and by_name["UPDATE.step.early"][4] == 5_000
    ends = max(r[3] + r[4] for r in second if r[1] not in ("COMM", "UPDATE") or r[0] == "UPDATE.step.early")
    assert ends == 45_000                                    # laid end to end, they end when the last op ended
    for rows in (first, second):
        starts = sorted((r[3], r[3] + r[4]) for r in rows if r[2] == 0)
        assert all(b[0] >= a[1] for a, b in zip(starts, starts[1:], strict=False))    # no two events overlap


def test_bad_xplane_files_name_the_file(tmp_path: Path) -> None:
    junk = tmp_path / "vm.xplane.pb"
    junk.write_bytes(b"\x0a\xff\xff\xff\xff\x0f garbage")
    with pytest.raises(TraceError, match="vm.xplane.pb"):
        read_xplane(junk)
    empty = tmp_path / "empty.xplane.pb"
    empty.write_bytes(b"")
    with pytest.raises(TraceError, match="profile_start_time"):
        read_xplane(empty)
    with pytest.raises(TraceError, match="cannot read"):
        read_xplane(tmp_path / "missing.xplane.pb")


@pytest.mark.parametrize("text, problem", [
    ("{not json", "TF_CONFIG is not valid"),
    ('{"cluster": {"worker": ["a:1"]}, "task": {"type": "worker", "index": 3}}', "outside the 1 workers"),
    ('{"cluster": {"worker": ["nohostport"]}, "task": {"type": "worker", "index": 0}}', "host:port"),
    ('{"cluster": {"ps": ["a:1"]}, "task": {"type": "ps", "index": 0}}', "TF_CONFIG is not valid"),
])
def test_bad_tf_config_is_a_usage_error(text: str, problem: str) -> None:
    with pytest.raises(UsageError, match=problem):
        tf_config({"TF_CONFIG": text})


def test_the_side_channel_port_is_a_port_whatever_worker_0s() -> None:
    from dpro.plugins.tf.transport import side_port_of

    assert side_port_of(12345) == 12345 + 7919
    assert all(1024 <= side_port_of(p) <= 65535 for p in (1024, 57617, 60999, 65535))  # 60999 + 7919 was refused
    assert len({side_port_of(p) for p in range(1024, 65536)}) == 65536 - 1024


# ---- real jobs -------------------------------------------------------------------------------------

def _free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def _mwms(run_dir: Path, *args: str, workers: int = 2, timeout: float = 240, script: str = "tf_keras_job.py",
          **env: str) -> list[subprocess.CompletedProcess]:
    """A real MWMS job, one process per worker on loopback; asserts every worker succeeded."""
    results = rerun_if_killed_in_framework(lambda: _mwms_once(run_dir, args, workers, timeout, script, env),
                                           run_dir, lambda rs: any(r.returncode != 0 for r in rs))
    for r in results:
        assert r.returncode == 0, f"worker failed ({r.returncode}):\n{r.stderr[-6000:]}"
    return results


def _mwms_once(run_dir: Path, args: tuple[str, ...], workers: int, timeout: float, script: str,
               env: dict[str, str]) -> list[subprocess.CompletedProcess]:
    ports = _free_ports(workers + 1)
    cluster = [f"127.0.0.1:{p}" for p in ports[:workers]]
    procs = []
    for i in range(workers):
        tf_conf = json.dumps({"cluster": {"worker": cluster}, "task": {"type": "worker", "index": i}})
        procs.append(subprocess.Popen([sys.executable, str(JOBS / script), "--run-dir", str(run_dir), *args],
                                      env=job_env(TF_CONFIG=tf_conf, DPRO_TF_PORT=str(ports[-1]), **env),
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    results = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=timeout)
            results.append(subprocess.CompletedProcess(p.args, p.returncode, out, err))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    return results


def _events(run_dir: Path, rank: int) -> list[dict]:
    doc = json.loads((run_dir / f"rank-{rank}.json").read_text())
    return [e for e in doc["traceEvents"] if e.get("ph") == "X"]


@pytest.mark.slow
def test_mwms_fit_records_every_layer_and_the_gradient_bytes(tmp_path: Path) -> None:
    run = tmp_path / "run"
    _mwms(run, "--steps", "14", "--profile", "6:10")
    meta = json.loads((run / "run.json").read_text())
    assert meta["engine"] == "tf-mwms" and meta["world_size"] == 2 and meta["profiled_steps"] == [6, 7, 8, 9]
    model = json.loads((run / "model.json").read_text())
    grad_bytes = sum(g["bytes"] for g in model["gradients"])
    assert {g["computed_by"] for g in model["gradients"]} == set(WEIGHTED)
    assert (run / "xplane-rank0").is_dir() and (run / "xplane-rank1").is_dir()  # the raw profile is kept
    for rank in (0, 1):
        events = _events(run, rank)
        overhead = json.loads((run / f"rank-{rank}.json").read_text())["recording_overhead"]  # for `dpro info`
        assert overhead["recorded_steps"] == 3 and overhead["unrecorded_steps"] == 4, overhead
        for step in (6, 7, 8, 9):
            names = {e["name"] for e in events if e["args"]["step"] == step}
            for layer in WEIGHTED:
                assert f"FW.{layer}" in names and f"BW.{layer}" in names, (rank, step, layer)
            packs = [e for e in events if e["args"]["step"] == step and e["name"].startswith("COMM.pack")]
            assert sum(e["args"]["bytes"] for e in packs) == grad_bytes
            step_event = next(e for e in events if e["name"] == "STEP" and e["args"]["step"] == step)
            inside = [e for e in events if e["args"]["step"] == step and e["name"] != "STEP"]
            assert all(step_event["ts"] <= e["ts"] <= step_event["ts"] + step_event["dur"] for e in inside)
    out = subprocess.run([sys.executable, "-m", "dpro", "analyze", str(run), "--json"], capture_output=True,
                         text=True, timeout=120, env=job_env())
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["predicted_step_ms"] > 0


@pytest.mark.slow
@pytest.mark.parametrize("keras", ["tf_keras", "keras3"])
def test_custom_mwms_loop_records_every_layer(tmp_path: Path, keras: str) -> None:
    run = tmp_path / "run"
    _mwms(run, "--steps", "12", "--profile", "5:9", *(["--keras3"] if keras == "keras3" else []),
          script="tf_custom_loop.py")
    meta = json.loads((run / "run.json").read_text())
    assert meta["engine"] == "tf-mwms" and meta["profiled_steps"] == [5, 6, 7, 8]
    grad_bytes = sum(g["bytes"] for g in json.loads((run / "model.json").read_text())["gradients"])
    assert grad_bytes == 4 * (12 * 48 + 48 + 48 * 48 + 48 + 48 * 4 + 4)
    for rank in (0, 1):
        events = _events(run, rank)
        for step in (5, 6, 7, 8):
            mine = [e for e in events if e["args"]["step"] == step]
            names = {e["name"] for e in mine}
            for layer in ("hidden1", "hidden2", "head"):
                assert f"FW.{layer}" in names and f"BW.{layer}" in names, (keras, rank, step, layer)
            assert any(n.startswith("UPDATE") for n in names)
            assert sum(e["args"]["bytes"] for e in mine if e["name"].startswith("COMM.pack")) == grad_bytes
    out = subprocess.run([sys.executable, "-m", "dpro", "analyze", str(run), "--json"], capture_output=True,
                         text=True, timeout=120, env=job_env())
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["predicted_step_ms"] > 0


@pytest.mark.slow
def test_bytes_per_pack_shows_in_the_recorded_collectives(tmp_path: Path) -> None:
    run = tmp_path / "run"
    _mwms(run, "--steps", "10", "--profile", "5:7", "--bytes-per-pack", "4096")
    meta = json.loads((run / "run.json").read_text())
    assert meta["knobs"]["tf.mwms.bytes_per_pack"] == 4096
    packs = {e["name"] for e in _events(run, 0) if e["name"].startswith("COMM.pack")}
    assert len(packs) > 1


@pytest.mark.slow
def test_keras3_single_worker_fit(tmp_path: Path) -> None:
    run = tmp_path / "run"
    proc = subprocess.run([sys.executable, str(JOBS / "tf_keras_job.py"), "--run-dir", str(run), "--keras3",
                           "--steps", "10", "--profile", "4:7"], capture_output=True, text=True, timeout=240,
                          env=job_env(TF_USE_LEGACY_KERAS="0"))
    assert proc.returncode == 0, proc.stderr[-6000:]
    meta = json.loads((run / "run.json").read_text())
    assert meta["engine"] == "tf" and meta["world_size"] == 1
    names = {e["name"] for e in _events(run, 0)}
    for layer in WEIGHTED:
        assert f"FW.{layer}" in names and f"BW.{layer}" in names, layer


@pytest.mark.slow
def test_existing_run_is_refused_on_every_worker(tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    (run / "run.json").write_text("{}")
    ports = _free_ports(3)
    cluster = [f"127.0.0.1:{p}" for p in ports[:2]]
    procs = [subprocess.Popen([sys.executable, str(JOBS / "tf_keras_job.py"), "--run-dir", str(run)],
                              env=job_env(TF_CONFIG=json.dumps({"cluster": {"worker": cluster},
                                                                "task": {"type": "worker", "index": i}}),
                                          DPRO_TF_PORT=str(ports[2])),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in range(2)]
    try:
        errs = [p.communicate(timeout=240)[1] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert all(p.returncode != 0 for p in procs)
    assert "never overwrites" in errs[0] and errs[0].count("dpro: error:") == 1  # once, by rank 0
    assert "dpro: error:" not in errs[1]
    assert not any("Traceback" in e for e in errs), errs


@pytest.mark.slow
def test_nested_blocks_are_paths_with_activation_bytes_and_a_recompute_config_is_applied(tmp_path: Path) -> None:
    run = tmp_path / "run"
    _mwms(run, "--steps", "10", "--profile", "5:8", script="tf_blocks_fit.py")
    model = json.loads((run / "model.json").read_text())
    acts = {m["name"]: m["activation_bytes"] for m in model["modules"] if m["recorded"]}
    # per worker: the global batch of 32 split over 2 workers, float32 outputs
    assert acts == {"block1.block1_wide": 16 * 512 * 4, "block1.block1_out": 16 * 32 * 4,
                    "block2.block2_wide": 16 * 256 * 4, "block2.block2_out": 16 * 32 * 4, "head": 16 * 4 * 4}
    assert {g["module"] for g in model["gradients"]} == set(acts)
    names = {e["name"] for e in _events(run, 0)}
    assert {"FW.block1.block1_wide", "BW.block1.block1_wide", "FW.head", "BW.head"} <= names
    assert not any(n.startswith("RECOMPUTE") for n in names)

    from dpro.io.load import load_run
    from dpro.sim.whatif import context

    peak = context(load_run(run)).memory.peak_bytes(())
    config = tmp_path / "config.json"
    out = subprocess.run([sys.executable, "-m", "dpro", "optimize", str(run), "--memory-budget", str(peak - 16 * 1024),
                          "-o", str(config)], capture_output=True, text=True, timeout=300, env=job_env())
    assert out.returncode == 0, out.stderr
    chosen = json.loads(config.read_text())["knobs"]["recompute"]
    assert chosen == ["block1"], chosen  # the block with the widest inner activation

    applied = tmp_path / "applied"
    _mwms(applied, "--steps", "10", "--profile", "5:8", "--config", str(config), script="tf_blocks_fit.py")
    for rank in (0, 1):
        events = _events(applied, rank)
        redone = [e for e in events if e["cat"] == "RECOMPUTE"]
        assert {e["name"] for e in redone} == {"RECOMPUTE.block1.block1_wide", "RECOMPUTE.block1.block1_out"}
        for step in (5, 6, 7):
            mine = [e for e in events if e["args"]["step"] == step]
            first_bw = min(e["ts"] for e in mine if e["cat"] == "BW")
            assert all(e["ts"] >= first_bw for e in mine if e["cat"] == "RECOMPUTE")  # inside the backward


@pytest.mark.slow
def test_keras3_recompute_is_applied_with_remat(tmp_path: Path) -> None:
    """Keras 3 (single worker: its fit under MWMS is broken upstream): a config's recompute wraps the block in
    keras.remat, and the block's forward shows again inside the backward."""
    config = tmp_path / "config.json"
    run = tmp_path / "run"

    def fit(run_dir: Path, *extra: str) -> None:
        proc = subprocess.run([sys.executable, str(JOBS / "tf_blocks_fit.py"), "--run-dir", str(run_dir), "--keras3",
                               "--steps", "9", "--profile", "5:8", *extra], capture_output=True, text=True,
                              timeout=240, env=job_env(TF_USE_LEGACY_KERAS="0"))
        assert proc.returncode == 0, proc.stderr[-6000:]

    fit(run)
    from dpro.config import Config, write_config

    meta = json.loads((run / "run.json").read_text())
    write_config(config, Config(fingerprint={"framework": "tf", "engine": meta["engine"], "world_size": 1,
                                             "model": meta["model_fingerprint"]}, knobs={"recompute": ["block2"]}))
    fit(tmp_path / "applied", "--config", str(config))
    names = {e["name"] for e in _events(tmp_path / "applied", 0)}
    assert {"RECOMPUTE.block2.block2_wide", "RECOMPUTE.block2.block2_out"} <= names
    assert not any(n.startswith("RECOMPUTE.block1") for n in names)


@pytest.mark.slow
def test_a_block_ends_in_the_gap_so_stopping_the_profiler_is_in_no_recorded_step(tmp_path: Path, monkeypatch) -> None:
    """Stopping TensorFlow's profiler (collecting and writing its XPlane) takes longer than a small step: done at the
    end of a block's last step it would be in that recorded step's time on the overhead's clock (and in any step clock
    after dpro's callback), so the block is stopped as the gap's first step begins."""
    import time

    import numpy as np
    import tensorflow as tf

    from dpro.plugins.tf.callback import DproCallback

    keras = pytest.importorskip("keras")
    stops: list[float] = []
    real_stop = tf.profiler.experimental.stop

    def stop() -> None:
        stops.append(time.perf_counter())
        real_stop()

    monkeypatch.setattr(tf.profiler.experimental, "stop", stop)
    model = keras.Sequential([keras.Input(shape=(4,)), keras.layers.Dense(8), keras.layers.Dense(1)])
    model.compile(optimizer="sgd", loss="mse")
    callback = DproCallback(run_dir=tmp_path / "run", steps=[2, 3, 6, 7])
    model.fit(np.zeros((80, 4), "f4"), np.zeros(80, "f4"), batch_size=8, epochs=1, verbose=0, callbacks=[callback])
    ends = callback.recorder._step_ends  # iteration -> (perf_counter, thread CPU) at its end, as the overhead uses
    assert len(stops) == 2
    assert ends[3][0] < stops[0] < ends[4][0]  # the first block (2, 3) stopped inside step 4, a gap step
    events = _events(tmp_path / "run", 0)
    assert {e["args"]["step"] for e in events if e["cat"] == "FW"} == {2, 3, 6, 7}


def test_the_fit_batch_size_comes_from_its_arguments() -> None:
    import numpy as np
    import tensorflow as tf

    from dpro.plugins.tf.autoattach import fit_batch_size

    data = tf.data.Dataset.from_tensor_slices((np.zeros((100, 3), "f4"), np.zeros(100, "f4")))
    assert fit_batch_size({"x": data.batch(24)}) == 24                       # read from its first batch
    assert fit_batch_size({"x": data.batch(24, drop_remainder=True)}) == 24  # its static shape
    assert fit_batch_size({"x": np.zeros((100, 3)), "batch_size": 10}) == 10
    assert fit_batch_size({"x": np.zeros((100, 3))}) == 32                   # Keras's default
    assert fit_batch_size({"x": iter([1, 2])}) is None


def test_horovod_allreduces_become_one_comm_per_gradient() -> None:
    from dpro.plugins.tf.ops import horovod_rows
    from dpro.plugins.tf.xplane import AsyncOp

    layout = Layout(layers=frozenset({"fc"}), gradients=(("fc.kernel", 400), ("fc.bias", 8)))
    scope = "PartitionedCall/DistributedSGD_Allreduce/cond{}/HorovodAllreduce_grads{}"
    ops = [AsyncOp(scope.format("_1", "_1_0"), "HorovodAllreduce", 10_000, 30_000),
           AsyncOp(scope.format("", "_0"), "HorovodAllreduce", 12_000, None),   # completion not traced
           AsyncOp("IteratorGetNext", "IteratorGetNext", 1_000, 2_000)]
    rows = horovod_rows(ops, step=4, layout=layout, wall_minus_mono_ns=0, step_end_ns=50_000)
    by_name = {r[0]: r for r in rows}
    assert set(by_name) == {"COMM.fc.kernel.allreduce", "COMM.fc.bias.allreduce"}  # grads_0 is the first variable
    kernel, bias = by_name["COMM.fc.kernel.allreduce"], by_name["COMM.fc.bias.allreduce"]
    assert kernel[5]["bytes"] == 400 and kernel[5]["hvd_name"] == ops[1].name and kernel[5]["tensors"] == ["fc.kernel"]
    assert kernel[3] == 12_000 and kernel[4] == 38_000 and "not traced" in kernel[5]["note"]  # ends with the step
    assert bias[3] == 10_000 and bias[4] == 20_000 and bias[5]["bytes"] == 8
