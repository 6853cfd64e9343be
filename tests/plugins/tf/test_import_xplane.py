"""`dpro import-xplane`: a TensorBoard profile of a real tf_keras fit becomes a run directory dpro analyzes."""

from __future__ import annotations

import json
import random
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from jobrunner import JOBS, job_env

pytest.importorskip("tensorflow")

from dpro.cli import main  # noqa: E402
from dpro.plugins.tf.importer import _numbered, default_output, profile_files  # noqa: E402

WEIGHTED = ("conv1", "bn1", "fc1", "fc2")
PROFILED = [3, 4, 5, 6]


def _dpro(*argv: str, capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture(scope="module")
def logdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real TensorBoard log dir of a 1-thread tf_keras fit, batches 3..6 profiled (recorded once)."""
    logs = tmp_path_factory.mktemp("tb") / "logs"
    proc = subprocess.run([sys.executable, str(JOBS / "tf_profiled_fit.py"), str(logs)], capture_output=True,
                          text=True, timeout=240, env=job_env(CUDA_VISIBLE_DEVICES=""))
    assert proc.returncode == 0, proc.stderr[-6000:]
    return logs


def _events(run: Path, rank: int = 0) -> list[dict]:
    doc = json.loads((run / f"rank-{rank}.json").read_text())
    return [e for e in doc["traceEvents"] if e.get("ph") == "X"]


@pytest.mark.slow
def test_a_keras_profile_imports_with_every_weighted_layer_and_analyzes(
        logdir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = tmp_path / "run"
    code, out, err = _dpro("import-xplane", str(logdir), "-o", str(run), capsys=capsys)
    assert code == 0, err
    assert str(run) in out
    meta = json.loads((run / "run.json").read_text())
    assert meta["framework"] == "tf" and meta["engine"] == "tf" and meta["world_size"] == 1
    assert meta["profiled_steps"] == PROFILED  # 4 and 5 from tf_keras's "train" events, 3 and 6 by neighbours
    assert meta["tf"]["gradient_sizes"] == "unknown" and any("sorted path order" in n for n in meta["notes"])
    model = json.loads((run / "model.json").read_text())
    assert {g["computed_by"] for g in model["gradients"]} == set(WEIGHTED)
    events = _events(run)
    for step in PROFILED:
        names = {e["name"] for e in events if e["args"]["step"] == step}
        assert "STEP" in names and "UPDATE.optimizer" in names, (step, names)
        for layer in WEIGHTED:
            assert f"FW.{layer}" in names and f"BW.{layer}" in names, (step, layer, names)
        step_event = next(e for e in events if e["name"] == "STEP" and e["args"]["step"] == step)
        inside = [e for e in events if e["args"]["step"] == step and e["name"] != "STEP"]
        assert all(step_event["ts"] <= e["ts"] and e["ts"] + e["dur"] <= step_event["ts"] + step_event["dur"] + 1
                   for e in inside)
    code, out, err = _dpro("analyze", str(run), capsys=capsys)
    assert code == 0, err
    assert "prediction error" in out and (run / "analysis" / "replay.json").is_file()
    assert _dpro("info", str(run), capsys=capsys)[0] == 0
    code, out, err = _dpro("whatif", str(run), "--set", "bandwidth_scale=10", "--json", capsys=capsys)
    assert code == 0 and json.loads(out)["predicted_step_ms"] > 0, err


@pytest.mark.slow
def test_a_session_folder_or_one_file_imports_and_nothing_is_overwritten(
        logdir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (pb,) = profile_files(logdir)
    for src, out in ((pb.parent, tmp_path / "a"), (pb, tmp_path / "b")):
        assert _dpro("import-xplane", str(src), "-o", str(out), capsys=capsys)[0] == 0
        assert json.loads((out / "run.json").read_text())["profiled_steps"] == PROFILED
    before = (tmp_path / "a" / "rank-0.json").read_bytes()
    code, _, err = _dpro("import-xplane", str(pb), "-o", str(tmp_path / "a"), capsys=capsys)
    assert code == 2 and "already exists" in err and err.count("\n") == 1
    assert (tmp_path / "a" / "rank-0.json").read_bytes() == before


@pytest.mark.slow
def test_a_truncated_profile_is_refused_naming_the_file(
        logdir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (pb,) = profile_files(logdir)
    cut = tmp_path / "vm.xplane.pb"
    cut.write_bytes(pb.read_bytes()[: pb.stat().st_size // 2])
    code, _, err = _dpro("import-xplane", str(cut), "-o", str(tmp_path / "run"), capsys=capsys)
    assert code == 2 and err.startswith("dpro: error: ") and str(cut) in err and err.count("\n") == 1
    assert not (tmp_path / "run").exists()


def test_a_directory_without_profiles_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "logs" / "train").mkdir(parents=True)
    code, _, err = _dpro("import-xplane", str(tmp_path / "logs"), capsys=capsys)
    assert code == 2 and "no TensorFlow profile here" in err and str(tmp_path / "logs") in err
    assert err.count("\n") == 1 and not default_output(tmp_path / "logs").exists()


def test_a_foreign_file_is_refused_naming_it(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    junk = tmp_path / "plugins" / "profile" / "s1" / "vm.xplane.pb"
    junk.parent.mkdir(parents=True)
    junk.write_bytes(b"\x0a\xff\xff\xff\xff\x0f not a protobuf")
    code, _, err = _dpro("import-xplane", str(tmp_path), "-o", str(tmp_path / "run"), capsys=capsys)
    assert code == 2 and str(junk) in err and err.count("\n") == 1
    assert not (tmp_path / "run").exists()


def test_a_profile_without_training_steps_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A valid XSpace (profile start, a host plane with one op) but no training function call or step event."""
    from tensorflow.tsl.profiler.protobuf import xplane_pb2

    space = xplane_pb2.XSpace()
    env = space.planes.add(name="Task Environment")
    env.stat_metadata[1].id, env.stat_metadata[1].name = 1, "profile_start_time"
    env.stats.add(metadata_id=1, uint64_value=1_700_000_000_000_000_000)
    host = space.planes.add(name="/host:CPU")
    host.event_metadata[1].id, host.event_metadata[1].name = 1, "model/fc1/MatMul:MatMul"
    host.lines.add(name="tf_Compute/1").events.add(metadata_id=1, offset_ps=1000, duration_ps=5000)
    host.event_metadata[2].id, host.event_metadata[2].name = 2, "eval_function"
    host.lines.add(name="python").events.add(metadata_id=2, offset_ps=0, duration_ps=9000)
    pb = tmp_path / "vm.xplane.pb"
    pb.write_bytes(space.SerializeToString())
    code, _, err = _dpro("import-xplane", str(pb), capsys=capsys)
    assert code == 2 and "no training steps found" in err and str(pb) in err and err.count("\n") == 1
    assert not default_output(pb).exists()


def test_step_numbers_fill_gaps_from_neighbours_and_fall_back_to_order() -> None:
    assert _numbered([None, 4, 5, None]) == ([3, 4, 5, 6], _numbered([None, 4, 5, None])[1])
    assert _numbered([None, None])[0] == [0, 1]
    assert _numbered([8, 9, 0, 1])[0] == [0, 1, 2, 3]   # two epochs: step_num restarts
    assert "profile order" in _numbered([0, None, 0])[1]


def test_the_cli_entry_needs_no_framework_until_it_runs() -> None:
    """``dpro --help`` lists the command without importing TensorFlow (core stays framework-free)."""
    code = ("import sys; from dpro.cli import build_parser; h = build_parser().format_help(); "
            "assert 'import-xplane' in h; assert 'tensorflow' not in sys.modules; print('ok')")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr


def test_default_output_is_next_to_the_profile(tmp_path: Path) -> None:
    assert default_output(tmp_path / "logs") == (tmp_path / "logs-dpro").resolve()
    assert default_output(tmp_path / "vm.xplane.pb") == (tmp_path / "vm-dpro").resolve()


# ---- fuzzing: a mutated profile imports or is refused naming the file --------------------------------------


def _mutated_space(raw: bytes, rng: random.Random) -> bytes:
    """A real XSpace with one thing changed: bytes cut or flipped, or one event, stat or line of a plane given a
    hostile value (huge or negative times, NaN, a metadata id that names nothing, a 10k-character name)."""
    from tensorflow.tsl.profiler.protobuf import xplane_pb2

    kind = rng.choice(("truncate", "flip", "event", "stat", "line", "metadata"))
    if kind == "truncate":
        return raw[: rng.randrange(len(raw))]
    if kind == "flip":
        out = bytearray(raw)
        out[rng.randrange(len(out))] ^= 1 << rng.randrange(8)
        return bytes(out)
    space = xplane_pb2.XSpace.FromString(raw)
    plane = rng.choice([p for p in space.planes if p.lines] or list(space.planes))
    lines = [line for line in plane.lines if line.events]
    if kind in ("event", "metadata") and lines:
        event = rng.choice(rng.choice(lines).events)
        if kind == "metadata":
            event.metadata_id = rng.choice((0, 999_999, 2**62))
        else:
            setattr(event, rng.choice(("offset_ps", "duration_ps")), rng.choice((0, 2**63 - 1, -(2**63), -1)))
    elif kind == "line" and plane.lines:
        line = rng.choice(plane.lines)
        choice = rng.randrange(3)
        if choice == 0:
            line.timestamp_ns = rng.choice((0, 2**63 - 1, -(2**63)))
        elif choice == 1:
            line.name = "x" * 10_000
        else:
            line.display_name = rng.choice(("", "python", "tf_Compute/1"))
    else:
        stats = [s for s in plane.stats] + [s for line in plane.lines for e in line.events for s in e.stats]
        if stats:
            stat = rng.choice(stats)
            field = rng.choice(("int64_value", "uint64_value", "double_value", "str_value", "ref_value"))
            value = {"int64_value": rng.choice((-(2**63), 2**63 - 1)), "uint64_value": rng.choice((0, 2**64 - 1)),
                     "double_value": rng.choice((float("nan"), float("inf"), -1e308)),
                     "str_value": rng.choice(("", "x" * 10_000, "\u0000")), "ref_value": 999_999}[field]
            setattr(stat, field, value)
    return space.SerializeToString()


@pytest.mark.slow
@settings(max_examples=30, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(rng=st.randoms(use_true_random=False))
def test_a_mutated_profile_imports_or_is_refused_naming_it(logdir: Path, tmp_path: Path, rng: random.Random) -> None:
    from dpro.analyze import analyze_path
    from dpro.errors import DproError
    from dpro.plugins.tf.importer import import_xplane

    case = tmp_path / uuid.uuid4().hex
    case.mkdir()
    pb = case / "vm.xplane.pb"
    pb.write_bytes(_mutated_space(profile_files(logdir)[0].read_bytes(), rng))
    try:
        run = import_xplane(pb, case / "run")
    except DproError as err:
        assert str(pb) in str(err), str(err)
        return
    try:
        analyze_path(run)
    except DproError as err:
        assert str(run) in str(err), str(err)
