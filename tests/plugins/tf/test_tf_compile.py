"""The compile knob for Keras (jit_compile): the compile probe after the window (its passes, the model's state kept,
a model XLA cannot compile skipped with why), read back by dpro info and pricing ``whatif --set compile=<root>``;
a config's compile applied (the train step under XLA, without it again when XLA cannot compile it)."""

from __future__ import annotations

import json
import logging
import os
import sys
from pathlib import Path

import pytest
from jobrunner import JOBS, job_env, run_job

pytest.importorskip("tensorflow")
keras = pytest.importorskip("keras")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

from dpro.cli import main  # noqa: E402
from dpro.config import Config, write_config  # noqa: E402
from dpro.io.load import load_run  # noqa: E402
from dpro.io.probes import read_probes  # noqa: E402
from dpro.plugins.tf.apply import apply_compile  # noqa: E402
from dpro.plugins.tf.autoattach import fit_probe_batch  # noqa: E402
from dpro.plugins.tf.probes import WHOLE_MODEL_ONLY, probe_document  # noqa: E402
from dpro.sim.probes import with_compile  # noqa: E402
from dpro.sim.whatif import context, predict, replay_model  # noqa: E402

XLA_RAN = "Compiled cluster using XLA"  # TensorFlow's log line (TF_CPP_MIN_LOG_LEVEL=0) once XLA compiled a function


def _host_side(t: tf.Tensor) -> tf.Tensor:
    """Identity, through a numpy function on the way (no gradient needed): an op XLA has no kernel for."""
    seen = tf.ensure_shape(tf.numpy_function(lambda a: a, [t], tf.float32), t.shape)
    return t + 0.0 * tf.stop_gradient(seen)


def small_model(*, xla_proof: bool = True) -> keras.Model:
    inputs = keras.Input((8,), name="x")
    x = keras.layers.Dense(16, activation="relu", name="fc1")(inputs)
    x = keras.layers.BatchNormalization(name="bn")(x)
    x = keras.layers.Dropout(0.2, name="drop")(x)
    if not xla_proof:
        x = keras.layers.Lambda(_host_side, name="host_side")(x)
    model = keras.Model(inputs, keras.layers.Dense(2, name="fc2")(x), name="small")
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    return model


# ---- in process ------------------------------------------------------------------------------------------------


def test_the_compile_probe_times_both_phases_and_leaves_the_model_as_it_was(monkeypatch):
    monkeypatch.delenv("DPRO_PROBE_COMPILE", raising=False)  # unset: <root>
    model = small_model()
    before = [v.numpy().copy() for v in model.variables]  # weights, BatchNorm's statistics, the seed generator
    doc = probe_document(model, rank=0, strategy=model.distribute_strategy, batch=None, rows=8)
    assert doc["schema"] == "dpro.probes/1" and doc["batch"] == 8 and doc["skipped"] == []
    [probe] = doc["probes"]
    assert probe["compile"] == "<root>" and probe["amp"] is None and probe["passes"] >= 3
    assert set(probe["ops"]) == set(probe["eager"]) == {"FW", "BW"}
    assert all(v > 0 for v in (*probe["ops"].values(), *probe["eager"].values()))
    assert all(np.array_equal(a, v.numpy()) for a, v in zip(before, model.variables, strict=True))


def test_a_model_xla_cannot_compile_is_skipped_with_why(monkeypatch):
    monkeypatch.setenv("DPRO_PROBE_COMPILE", "<root>,fc1")
    doc = probe_document(small_model(xla_proof=False), rank=0, strategy=tf.distribute.get_strategy(),
                         batch=lambda: tf.ones((4, 8)), rows=None)
    assert doc["probes"] == []
    whys = {s["probe"]: s["why"] for s in doc["skipped"]}
    assert whys["compile fc1"] == WHOLE_MODEL_ONLY  # Keras compiles the whole train function
    assert "Detected unsupported operations" in whys["compile <root>"] and "PyFunc" in whys["compile <root>"]


def test_no_probe_when_turned_off_or_when_the_model_already_runs_compiled(monkeypatch):
    monkeypatch.setenv("DPRO_PROBE_COMPILE", "0")
    model = small_model()
    assert probe_document(model, rank=0, strategy=model.distribute_strategy, batch=None, rows=8)["skipped"] == []
    monkeypatch.delenv("DPRO_PROBE_COMPILE")
    model.jit_compile = True
    doc = probe_document(model, rank=0, strategy=model.distribute_strategy, batch=None, rows=8)
    assert doc["skipped"] == [{"probe": "compile <root>", "why": "the model already runs under jit_compile"}]


class _JitSeen(keras.callbacks.Callback):
    def __init__(self) -> None:
        super().__init__()
        self.seen: list[bool] = []

    def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
        self.seen.append(bool(self.model.jit_compile))


@pytest.mark.parametrize("xla_proof", [True, False])
def test_apply_compile_runs_the_step_under_xla_or_falls_back(xla_proof, caplog, monkeypatch):
    monkeypatch.setattr(logging.getLogger("dpro"), "propagate", True)  # dpro's own handler speaks otherwise
    model = small_model(xla_proof=xla_proof)
    with pytest.warns(UserWarning, match="compile=fc1 is not applied: Keras compiles its whole train function"):
        assert apply_compile(model, ["<root>", "fc1"], "test") == ["<root>"]
    seen = _JitSeen()
    history = model.fit(np.ones((64, 8), "f4"), np.ones((64, 2), "f4"), batch_size=8, epochs=1, verbose=0,
                        callbacks=[seen])
    assert np.isfinite(history.history["loss"][-1])
    if xla_proof:
        assert seen.seen == [True] * 8
    else:  # the first step failed to compile: the rest of the fit ran without XLA (that call's batch taken)
        assert seen.seen and not any(seen.seen)
        assert "did not compile under XLA" in caplog.text and "PyFunc" in caplog.text


def test_the_fit_first_batch_feeds_the_probe() -> None:
    data = tf.data.Dataset.from_tensor_slices((np.arange(40, dtype="f4").reshape(20, 2), np.zeros(20, "f4")))
    first = fit_probe_batch({"x": data.batch(4)}, 4)
    assert first is not None and first().numpy().tolist() == [[0, 1], [2, 3], [4, 5], [6, 7]]  # x, not (x, y)
    arrays = fit_probe_batch({"x": {"a": np.zeros((10, 3)), "b": np.ones((10, 1))}}, 4)
    assert {k: v.shape.as_list() for k, v in arrays().items()} == {"a": [4, 3], "b": [4, 1]}
    assert fit_probe_batch({"x": np.zeros((10, 3))}, None) is None
    assert fit_probe_batch({}, 4) is None


# ---- real jobs -------------------------------------------------------------------------------------------------


def _fit(run_dir: Path, *extra: str, **env: str) -> str:
    proc = run_job([sys.executable, str(JOBS / "tf_blocks_fit.py"), "--run-dir", str(run_dir), "--keras3", "--steps",
                    "9", "--profile", "5:8", *extra], timeout=240, env=job_env(TF_USE_LEGACY_KERAS="0", **env))
    return proc.stderr


@pytest.fixture(scope="module")
def probed_run(tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("keras-compile") / "run"
    _fit(run, DPRO_PROBE_COMPILE="<root>")
    return run


@pytest.mark.slow
def test_the_probe_is_read_back_by_info_and_prices_compile(probed_run, capsys):
    probes = read_probes(probed_run)
    assert sorted(probes) == [0] and probes[0].compiled_regions == ["<root>"]
    assert probes[0].compiled("<root>").batch == 32  # the job's batch (tf_blocks_fit.py: 32 on one worker)
    run = load_run(probed_run)
    assert run.meta["probes"]["probes"] == ["compile <root>"] and "compile" not in run.meta["knobs"]
    assert all(e["args"]["step"] in (5, 6, 7) for trace in run.ranks.values() for e in trace.events)
    assert main(["info", str(probed_run)]) == 0
    assert "compiled <root>" in capsys.readouterr().out
    assert main(["whatif", str(probed_run), "--set", "compile=<root>", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    ctx = context(run)
    expected = replay_model(ctx, with_compile(ctx.base, ctx.probes, ["<root>"]), {"compile": ["<root>"]})
    assert out["predicted_step_ms"] == pytest.approx(expected.predicted_step_ms)
    assert out["predicted_step_ms"] != pytest.approx(predict(ctx, {}).predicted_step_ms, rel=1e-6)


@pytest.mark.slow
def test_a_config_compile_runs_the_fit_under_xla(probed_run, tmp_path):
    meta = json.loads((probed_run / "run.json").read_text())
    config = tmp_path / "config.json"
    write_config(config, Config(fingerprint={"framework": "tf", "engine": meta["engine"], "world_size": 1,
                                             "model": meta["model_fingerprint"]}, knobs={"compile": ["<root>"]}))
    applied = tmp_path / "applied"
    stderr = _fit(applied, "--config", str(config), DPRO_PROBE_COMPILE="<root>", TF_CPP_MIN_LOG_LEVEL="0")
    assert XLA_RAN in stderr
    recorded = json.loads((applied / "run.json").read_text())
    assert recorded["knobs"]["compile"] == ["<root>"]  # model.jit_compile, read as the window opened
    assert recorded["probes"]["skipped"] == ["compile <root>: the model already runs under jit_compile"]
    assert main(["whatif", str(applied), "--set", "compile=none"]) != 0  # recorded compiled: not priced


@pytest.mark.slow
def test_dpro_launch_probes_an_unmodified_fit_and_applies_compile(tmp_path):
    env = job_env(PATH=str(Path(sys.executable).parent) + os.pathsep + os.environ.get("PATH", ""),
                  DPRO_PROBE_COMPILE="<root>", TF_CPP_MIN_LOG_LEVEL="0")
    job = ["python", str(JOBS / "keras3_plain_fit.py"), "--steps", "8", "--report-jit"]
    launch = [sys.executable, "-m", "dpro.launch", "--engine", "tf", "-np", "1", "--profile", "3:6"]
    proc = run_job([*launch, "--run-dir", "rec", *job], env=env, cwd=tmp_path, timeout=240)
    assert proc.stdout.count("JIT_COMPILE False") == 8  # (XLA ran in the probe after the window)
    probe = read_probes(tmp_path / "rec")[0].compiled("<root>")
    assert probe is not None and probe.batch == 16  # the fit's first batch, taken after the window
    meta = json.loads((tmp_path / "rec" / "run.json").read_text())
    config = tmp_path / "config.json"
    write_config(config, Config(fingerprint={"framework": "tf", "engine": meta["engine"], "world_size": 1,
                                             "model": meta["model_fingerprint"]}, knobs={"compile": ["<root>"]}))
    applied = run_job([*launch, "--run-dir", "applied", "--apply", str(config), *job], env=env, cwd=tmp_path,
                      timeout=240)
    assert "compile=['<root>']" in applied.stderr and XLA_RAN in applied.stderr
    assert applied.stdout.count("JIT_COMPILE True") == 8
