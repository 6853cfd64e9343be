"""The ``compile`` knob for Gluon (``hybridize(static_alloc=True)``): the compile probe after the window (it puts the
net back as it was), applying a config's compile (with its fallback), and, in a real dist_sync job, the probe
written, read back by what-if, and a config hybridizing the net it was made for. The in-process tests run in the
MXNet venv (``make test`` runs them there); the job test starts the MXNet venv's interpreter."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from jobrunner import JOBS, job_env, run_job

ROOT = Path(__file__).resolve().parents[3]
MXNET_PYTHON = ROOT / ".venv-mxnet" / "bin" / "python"


# ---- in-process, in the MXNet venv -------------------------------------------------------------------


def _mxnet():
    return pytest.importorskip("mxnet")


def _net(mx, *, hybrid_features: bool = False):
    """Convolutions (optionally hybridized, as a job may have them), BatchNorm, dense layers; a few steps trained."""
    from mxnet import autograd, gluon, nd

    net = gluon.nn.HybridSequential()
    with net.name_scope():
        features = gluon.nn.HybridSequential()
        features.add(gluon.nn.Conv2D(4, 3, activation="relu"), gluon.nn.BatchNorm(), gluon.nn.Conv2D(8, 3))
        net.add(features, gluon.nn.Flatten(), gluon.nn.Dense(16, activation="relu"), gluon.nn.Dense(10))
    net.initialize(mx.init.Xavier())
    if hybrid_features:
        features.hybridize()
    trainer = gluon.Trainer(net.collect_params(), "sgd", {"learning_rate": 0.05})
    loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()
    x, y = nd.random.uniform(shape=(4, 3, 10, 10)), nd.array([0, 1, 2, 3])
    for _ in range(3):
        with autograd.record():
            loss = loss_fn(net(x), y)
        loss.backward()
        trainer.step(4)
    return net, trainer, x


def _values(net) -> dict[str, list]:
    """Every parameter's data and gradient, as numbers."""
    out = {}
    for name, p in net.collect_params().items():
        out[name] = p.data().asnumpy().tolist()
        if p.grad_req != "null":
            out[name + ".grad"] = p.grad().asnumpy().tolist()
    return out


def test_the_compile_probe_times_regions_and_puts_the_net_back_as_it_was(monkeypatch):
    mx = _mxnet()
    from dpro.plugins.mxnet.probes import run_compile_probes

    monkeypatch.setenv("DPRO_PROBE_COMPILE", "<root>,0,2,no.such")
    net, trainer, x = _net(mx, hybrid_features=True)
    features = net[0]
    features(x)  # its cached graph is built
    cached, flags = features._cached_op, features._flags
    before = _values(net)
    doc = run_compile_probes(net, (x,), rank=1)
    assert doc["schema"] == "dpro.probes/1" and doc["rank"] == 1 and doc["batch"] == 4
    assert [p["compile"] for p in doc["probes"]] == ["<root>", "2"]
    for probe in doc["probes"]:
        assert set(probe["ops"]) == set(probe["eager"]) == {"FW", "BW"} and probe["passes"] >= 3
        assert probe["amp"] is None and probe["batch"] == 4
    why = {s["probe"]: s["why"] for s in doc["skipped"]}
    assert "already runs hybridized" in why["compile 0"] and "no block at 'no.such'" in why["compile no.such"]
    # as it was: the root and its plain blocks imperative, the hybridized child with its own cached op, parameters,
    # gradients and BatchNorm's running statistics unchanged
    assert net._active is False and net._flags == [] and net._cached_op is None and net[2]._active is False
    assert features._active is True and features._cached_op is cached and features._flags == flags
    assert _values(net) == before
    net(x)
    assert net._cached_op is None  # the next forward runs imperative again


def test_the_compile_probe_skips_a_hybridized_net_and_a_missing_batch(monkeypatch):
    mx = _mxnet()
    from dpro.plugins.mxnet.probes import run_compile_probes

    monkeypatch.delenv("DPRO_PROBE_COMPILE", raising=False)  # <root> by default
    net, trainer, x = _net(mx)
    assert run_compile_probes(net, None, rank=0)["skipped"][0]["probe"] == "compile <root>"
    net.hybridize()
    doc = run_compile_probes(net, (x,), rank=0)
    assert doc["probes"] == [] and "already runs hybridized" in doc["skipped"][0]["why"]
    monkeypatch.setenv("DPRO_PROBE_COMPILE", "0")
    assert run_compile_probes(net, (x,), rank=0)["skipped"] == []


def test_a_config_hybridizes_the_blocks_it_names_with_static_alloc():
    mx = _mxnet()
    from dpro.errors import ConfigError
    from dpro.plugins.mxnet.apply import apply_compile, compiled, fingerprint

    net, trainer, x = _net(mx)
    made_for = fingerprint(net, trainer)
    assert apply_compile(net, ["<root>"]) == ["<root>"]
    assert net._active is True and dict(net._flags)["static_alloc"] is True
    assert dict(net._flags)["static_shape"] is False
    net(x)
    assert net._cached_op is not None and compiled(net) == ["<root>"]
    assert fingerprint(net, trainer) == made_for  # the config still fits the job it hybridized
    other, _, _ = _net(mx)
    with pytest.raises(ConfigError, match="features names no block"):
        apply_compile(other, ["features"])
    assert other._active is False


def test_a_block_whose_hybridized_forward_fails_runs_imperative_again():
    _mxnet()
    from mxnet import gluon, nd

    from dpro.plugins.mxnet.apply import apply_compile, compiled

    class ReadsShape(gluon.HybridBlock):
        def hybrid_forward(self, F, x):
            return x.reshape((x.shape[0], -1))  # a Symbol has no shape: fails hybridized

    net = gluon.nn.HybridSequential()
    net.add(ReadsShape(), gluon.nn.Dense(3))
    net.initialize()
    x = nd.ones((2, 2, 2))
    expected = net(x).asnumpy()
    apply_compile(net, ["<root>"])
    assert (net(x).asnumpy() == expected).all()
    assert net._active is False and compiled(net) == []
    assert (net(x).asnumpy() == expected).all()


def test_load_config_refuses_a_config_made_for_another_net(tmp_path):
    mx = _mxnet()
    from dpro.config import Config, write_config
    from dpro.errors import ConfigError
    from dpro.plugins.mxnet.apply import apply, fingerprint, load_config

    net, trainer, _ = _net(mx)
    fp = {"framework": "mxnet", "engine": "mxnet", "world_size": 1, "model": fingerprint(net, trainer)}
    path = tmp_path / "config.json"
    write_config(path, Config(fingerprint=fp, knobs={"compile": ["0"], "recompute": ["2"]}))
    config = load_config(path, net=net, trainer=trainer)
    assert apply(net, config) == ["recompute"]  # what the MXNet plugin does not apply
    assert net[0]._active is True and net._active is False
    write_config(path, Config(fingerprint={**fp, "model": "another"}, knobs={"compile": ["0"]}))
    with pytest.raises(ConfigError, match="model"):
        load_config(path, net=net, trainer=trainer)


# ---- a real dist_sync job ---------------------------------------------------------------------------


def _launch(*argv: str) -> list[str]:
    return [sys.executable, "-m", "dpro.launch", "--engine", "mxnet", "-np", "2", "-H", "localhost:2",
            "--num-servers", "1", *argv]


@pytest.mark.slow
@pytest.mark.skipif(not MXNET_PYTHON.exists(), reason="no MXNet venv here (make mxnet builds it)")
def test_the_probe_prices_compile_and_a_config_hybridizes_the_job(tmp_path):
    run, applied = tmp_path / "run", tmp_path / "applied"
    job = [str(MXNET_PYTHON), str(JOBS / "mxnet_gluon_job.py"), "--steps", "12"]
    env = job_env(DPRO_PROBE_COMPILE="<root>")
    run_job(_launch("--run-dir", str(run), "--profile", "3:9", *job), cwd=tmp_path, env=env, timeout=150)
    for rank in (0, 1):  # every worker probes (it communicates nothing)
        doc = json.loads((run / "probes" / f"rank-{rank}.json").read_text())
        assert [p["compile"] for p in doc["probes"]] == ["<root>"] and doc["batch"] == 32
    info = run_job([sys.executable, "-m", "dpro", "info", str(run)], timeout=120).stdout
    assert "compiled <root>" in info
    whatif = run_job([sys.executable, "-m", "dpro", "whatif", str(run), "--set", "compile=<root>"], timeout=120)
    assert "compile" in whatif.stdout and "ms" in whatif.stdout

    meta = json.loads((run / "run.json").read_text())
    config = {"schema": "dpro.config/1", "knobs": {"compile": ["<root>"]}, "explain": [],
              "fingerprint": {"framework": "mxnet", "engine": "mxnet-ps", "world_size": 2,
                              "model": meta["model_fingerprint"]}}
    (tmp_path / "config.json").write_text(json.dumps(config))
    proc = run_job(_launch("--run-dir", str(applied), "--profile", "3:9", "--apply", str(tmp_path / "config.json"),
                           *job), cwd=tmp_path, env=env, timeout=150)
    assert "hybridized <root> (static_alloc)" in proc.stderr
    again = json.loads((applied / "run.json").read_text())
    assert again["knobs"]["compile"] == ["<root>"] and again["model_fingerprint"] == meta["model_fingerprint"]
    # the net runs as one cached graph: its blocks share its forward time, said so
    trace = json.loads((applied / "rank-0.json").read_text())
    forward = [e for e in trace["traceEvents"] if e.get("ph") == "X" and e.get("cat") == "FW"]
    assert forward and all("hybridized" in e["args"]["estimated"] for e in forward)
    skipped = json.loads((applied / "probes" / "rank-0.json").read_text())["skipped"]
    assert "already runs hybridized" in skipped[0]["why"]
