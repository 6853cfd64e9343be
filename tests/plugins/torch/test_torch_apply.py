"""dpro.plugins.torch.apply: a config applied to real models, to real 2-rank DDP jobs and to Lightning jobs."""

from __future__ import annotations

import copy
import importlib.util
import re
import sys
import warnings

import pytest
from jobrunner import JOBS, run_job, torchrun

torch = pytest.importorskip("torch")

from torch import nn  # noqa: E402

from dpro.config import DPRO_CONFIG, Config, write_config  # noqa: E402
from dpro.engines import load_prepared  # noqa: E402
from dpro.errors import ConfigError, UsageError  # noqa: E402
from dpro.plugins.torch import apply, ddp_kwargs, load_config  # noqa: E402
from dpro.plugins.torch.apply import apply_recompute, fingerprint, recomputed  # noqa: E402
from dpro.plugins.torch.models import TinyTransformer, get_example  # noqa: E402
from dpro.record.trace import model_fingerprint  # noqa: E402

pytestmark = pytest.mark.slow  # every test here runs a real multi-process job


def make_config(model: nn.Module, world_size: int = 1, **knobs) -> Config:
    return Config(fingerprint={"framework": "torch", "engine": "torch-ddp", "world_size": world_size,
                               "model": fingerprint(model)}, knobs=knobs)


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return get_example("mlp").build()


# ---- load_config ---------------------------------------------------------------------------------------


def test_fingerprint_is_the_recorders():
    model = mlp()
    model.get_parameter("6.bias").requires_grad_(False)  # frozen parameters are not part of it
    expected = model_fingerprint((n, p.shape, str(p.dtype)) for n, p in model.named_parameters() if n != "6.bias")
    assert fingerprint(model) == expected


def test_load_config_from_argument_or_environment(tmp_path, monkeypatch):
    model = mlp()
    path = write_config(tmp_path / "config.json", make_config(model, **{"torch.ddp.bucket_cap_mb": 2}))
    monkeypatch.delenv(DPRO_CONFIG, raising=False)
    assert load_config(model=model) is None
    monkeypatch.setenv(DPRO_CONFIG, "")
    assert load_config(model=model) is None
    config = load_config(path, model=model)
    assert config.knobs == {"torch.ddp.bucket_cap_mb": 2.0} and config.path == path
    monkeypatch.setenv(DPRO_CONFIG, str(path))
    assert load_config(model=model) == config


def test_load_config_refuses_another_job(tmp_path):
    model = mlp()
    path = write_config(tmp_path / "config.json", make_config(model, world_size=2))
    with pytest.raises(ConfigError, match=re.escape(f"{path} (fingerprint): config was made for world_size 2, "
                                                    "this job has 1") + ".*pass force=True"):
        load_config(path, model=model)
    assert load_config(path, model=model, world_size=2) is not None
    with pytest.raises(ConfigError, match=r"config was made for model [0-9a-f]+, this job has [0-9a-f]+ \("):
        load_config(path, model=get_example("convnet").build(), world_size=2)
    with pytest.warns(UserWarning, match="made for another job .*world_size 2, this job has 1"):
        assert load_config(path, model=model, force=True) is not None


def test_load_config_warns_about_env_knobs_not_in_force(tmp_path, monkeypatch):
    model = mlp()
    made = Config(fingerprint={"framework": "torch", "engine": "horovod", "world_size": 1, "model": fingerprint(model)},
                  knobs={"env": {"HOROVOD_CYCLE_TIME": "2.5"}})  # a Horovod job's config (env: its knobs)
    path = write_config(tmp_path / "config.json", made)
    monkeypatch.delenv("HOROVOD_CYCLE_TIME", raising=False)
    with pytest.warns(UserWarning, match="not in force here: HOROVOD_CYCLE_TIME"):
        load_config(path, model=model, engine="horovod")
    monkeypatch.setenv("HOROVOD_CYCLE_TIME", "2.5")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        load_config(path, model=model, engine="horovod")


# ---- ddp_kwargs ----------------------------------------------------------------------------------------


def test_ddp_kwargs_bucket_sizes():
    model = mlp()
    assert ddp_kwargs(make_config(model)) == {}
    assert ddp_kwargs(make_config(model, **{"torch.ddp.bucket_cap_mb": 0.25})) == {"bucket_cap_mb": 0.25}
    same = make_config(model, **{"torch.ddp.bucket_cap_mb": 4, "torch.ddp.first_bucket_cap_mb": 4})
    assert ddp_kwargs(same) == {"bucket_cap_mb": 4.0}
    first = make_config(model, **{"torch.ddp.bucket_cap_mb": 4, "torch.ddp.first_bucket_cap_mb": 1})
    assert ddp_kwargs(first) == {"bucket_cap_mb_list": [1.0, 4.0]}
    only_first = make_config(model, **{"torch.ddp.first_bucket_cap_mb": 0.5})
    assert ddp_kwargs(only_first) == {"bucket_cap_mb_list": [0.5, 25.0]}


def test_ddp_kwargs_tensor_groups_become_exact_caps():
    model = mlp()
    sizes = {n: p.numel() * p.element_size() for n, p in model.named_parameters()}
    groups = [["6.bias", "6.weight", "4.bias", "4.weight"], ["2.bias", "2.weight"], ["0.bias", "0.weight"]]
    config = make_config(model, tensor_groups=groups, **{"torch.ddp.bucket_cap_mb": 9})
    caps = ddp_kwargs(config, model=model)["bucket_cap_mb_list"]
    assert [int(c * 2**20) for c in caps] == [sum(sizes[n] for n in g) for g in groups]  # exact in bytes
    with pytest.warns(UserWarning, match="tensor_groups need the parameter sizes.*bucket_cap_mb \\(9.0 MiB\\)"):
        assert ddp_kwargs(config) == {"bucket_cap_mb": 9.0}


def test_ddp_kwargs_tensor_groups_must_fit_the_model(tmp_path):
    model = mlp()
    path = write_config(tmp_path / "config.json", make_config(model, tensor_groups=[["6.bias", "9.weight"]]))
    with pytest.raises(ConfigError, match=re.escape(f'{path} (knobs["tensor_groups"][0][1]): the model has no '
                                                    "trainable parameter '9.weight'")):
        ddp_kwargs(load_config(path, model=model), model=model)
    partial = make_config(model, tensor_groups=[["6.bias", "6.weight"]])
    with pytest.raises(ConfigError, match=r'tensor_groups"\]\): the groups leave out 6 gradient\(s\): 0.weight'):
        ddp_kwargs(partial, model=model)


# ---- recompute -----------------------------------------------------------------------------------------


def saved_bytes(model: nn.Module, batch: torch.Tensor) -> int:
    """Bytes of the tensors autograd keeps for backward during one forward (pack hooks see each once)."""
    total = 0

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal total
        total += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = model(batch)
    out.sum().backward()
    return total


def transformer() -> nn.Module:
    torch.manual_seed(0)
    return TinyTransformer()


def test_recompute_keeps_fewer_activations_and_the_same_gradients():
    tokens = torch.randint(0, 1000, (8, 32), generator=torch.Generator().manual_seed(0))
    plain, wrapped = transformer(), transformer()
    assert apply(wrapped, make_config(wrapped, recompute=["encoder.0", "encoder.1"])) is wrapped
    assert recomputed(wrapped) == ["encoder.0", "encoder.1"] and recomputed(plain) == []
    torch.manual_seed(1)  # the same dropout masks in both
    kept_plain = saved_bytes(plain, tokens)
    torch.manual_seed(1)
    kept_wrapped = saved_bytes(wrapped, tokens)
    assert kept_wrapped < kept_plain / 2, (kept_wrapped, kept_plain)
    for (name, a), (_, b) in zip(plain.named_parameters(), wrapped.named_parameters(), strict=True):
        torch.testing.assert_close(a.grad, b.grad, msg=name)


def test_recomputed_children_run_again_in_backward():
    model = transformer()
    apply_recompute(model, ["encoder.0"])
    calls = {"encoder.0.linear1": 0, "encoder.1.linear1": 0}

    def count(name: str):
        def hook(*_) -> None:
            calls[name] += 1

        return hook

    for name in calls:
        model.get_submodule(name).register_forward_hook(count(name))
    out = model(torch.randint(0, 1000, (2, 8)))
    assert calls == {"encoder.0.linear1": 1, "encoder.1.linear1": 1}
    out.sum().backward()
    assert calls == {"encoder.0.linear1": 2, "encoder.1.linear1": 1}
    with torch.no_grad():  # no recomputation without autograd
        model(torch.randint(0, 1000, (2, 8)))
    assert calls == {"encoder.0.linear1": 3, "encoder.1.linear1": 2}


def test_recompute_is_idempotent_and_survives_deepcopy():
    model = transformer()
    apply_recompute(model, ["encoder.0"])
    apply_recompute(model, ["encoder.0"])
    twin = copy.deepcopy(model)
    assert recomputed(twin) == ["encoder.0"]
    with torch.no_grad():
        twin.encoder[0].linear1.weight.zero_()
    model.eval(), twin.eval()
    tokens = torch.randint(0, 1000, (2, 8))
    assert not torch.allclose(model(tokens), twin(tokens))  # the copy runs its own weights


def test_unknown_recompute_path_is_refused_and_nothing_is_wrapped(tmp_path):
    model = transformer()
    path = write_config(tmp_path / "config.json", make_config(model, recompute=["encoder.0", "encoder.7"]))
    with pytest.raises(ConfigError, match=re.escape(f'{path} (knobs["recompute"][1]): TinyTransformer has no '
                                                    "submodule 'encoder.7'")):
        apply(model, load_config(path, model=model))
    assert recomputed(model) == []


def test_recompute_refuses_a_ddp_model():
    ddp = torch.nn.parallel.DistributedDataParallel.__new__(torch.nn.parallel.DistributedDataParallel)
    with pytest.raises(UsageError, match="before wrapping it"):
        apply_recompute(ddp, ["0"])


# ---- real jobs -------------------------------------------------------------------------------------------


def config_for_run(run, **knobs) -> Config:
    """A config made for the job that recorded ``run`` (what `dpro optimize` would write)."""
    meta = run.meta
    return Config(fingerprint={"framework": meta["framework"], "engine": meta["engine"],
                               "world_size": meta["world_size"], "model": meta["model_fingerprint"]},
                  baseline={"run": str(run.path), "step_ms": 1.0}, knobs=knobs)


@pytest.fixture(scope="module")
def baseline(tmp_path_factory):
    """A 2-rank DDP run of the transformer at DDP's bucket size 25 MB (one bucket)."""
    run_dir = tmp_path_factory.mktemp("baseline") / "run"
    torchrun("ddp_job.py", "--model", "transformer", "--steps", "6", "--profile", "2:5", "--run-dir", str(run_dir))
    return load_prepared(run_dir)


def events(run, rank: int, step: int) -> list[dict]:
    return [e for e in run.ranks[rank].events if e["args"]["step"] == step]


def test_ddp_job_applies_bucket_size_and_recompute(tmp_path, baseline):
    assert baseline.meta["knobs"]["torch.ddp.bucket_cap_mb"] == 25.0 and len(baseline.model["buckets"]) == 1
    assert baseline.meta["model_fingerprint"] == fingerprint(get_example("transformer").build())
    config = write_config(tmp_path / "config.json", config_for_run(
        baseline, recompute=["encoder.0"], **{"torch.ddp.bucket_cap_mb": 0.25}))
    run_dir = tmp_path / "run"
    torchrun("ddp_job.py", "--model", "transformer", "--steps", "6", "--profile", "2:5", "--run-dir", str(run_dir),
             "--config", str(config))
    run = load_prepared(run_dir)
    assert run.meta["knobs"]["torch.ddp.bucket_cap_mb"] == 0.25
    assert len(run.model["buckets"]) > 1
    assert sum(b["bytes"] for b in run.model["buckets"]) == run.model["param_bytes"]
    for rank in (0, 1):
        for step in (2, 3, 4):
            evs = events(run, rank, step)
            first_bw = min(e["ts"] for e in evs if e["cat"] == "BW")
            fw = [e for e in evs if e["name"] == "FW.encoder.0.linear1"]
            again = [e for e in evs if e["name"] == "RECOMPUTE.encoder.0.linear1"]
            # recomputed: once in forward, once again (as RECOMPUTE) during backward; the other layer once
            assert len(fw) == 1 and len(again) == 1 and fw[0]["ts"] < first_bw < again[0]["ts"], (rank, step, fw)
            assert len([e for e in evs if e["name"] == "FW.encoder.1.linear1"]) == 1
            assert not [e for e in evs if e["name"] == "RECOMPUTE.encoder.1.linear1"]


def test_ddp_job_applies_tensor_groups(tmp_path, baseline):
    ready = [g["name"] for g in baseline.model["gradients"]]  # gradient-ready order
    groups = [ready[:4], ready[4:15], ready[15:]]
    config = write_config(tmp_path / "config.json", config_for_run(baseline, tensor_groups=groups))
    run_dir = tmp_path / "run"
    torchrun("ddp_job.py", "--model", "transformer", "--steps", "6", "--profile", "2:5", "--run-dir", str(run_dir),
             "--config", str(config))
    buckets = load_prepared(run_dir).model["buckets"]
    assert [sorted(b["tensors"]) for b in buckets] == [sorted(g) for g in groups]


def test_ddp_job_refuses_a_config_for_another_job(tmp_path, baseline):
    config = config_for_run(baseline)
    config.fingerprint.world_size = 4
    path = write_config(tmp_path / "config.json", config)
    proc = torchrun("ddp_job.py", "--model", "transformer", "--steps", "3", "--profile", "1:2", "--run-dir",
                    str(tmp_path / "run"), "--config", str(path), check=False)
    assert proc.returncode != 0
    assert "ConfigError" in proc.stderr and "config was made for world_size 4, this job has 2" in proc.stderr
    assert not (tmp_path / "run").exists()


def test_fp16_compression_replaces_dpro_comm_timing(tmp_path):
    config = Config(fingerprint={"framework": "torch", "engine": "torch-ddp", "world_size": 1,
                                 "model": fingerprint(get_example("mlp").build())},
                    knobs={"gradient_compression": "fp16"})
    path = write_config(tmp_path / "config.json", config)
    run_dir = tmp_path / "run"
    proc = torchrun("ddp_job.py", "--steps", "4", "--profile", "1:3", "--run-dir", str(run_dir), "--config",
                    str(path), nproc=1)
    assert "fp16_compress_hook" in proc.stderr and "COMM events are not recorded" in proc.stderr
    run = load_prepared(run_dir)
    assert run.meta["knobs"]["torch.ddp.comm_hook"] == "user hook"
    assert not [e for e in run.ranks[0].events if e["cat"] == "COMM"]


def test_bf16_compression_is_refused_on_gloo(tmp_path):
    config = Config(fingerprint={"framework": "torch", "engine": "torch-ddp", "world_size": 1,
                                 "model": fingerprint(get_example("mlp").build())},
                    knobs={"gradient_compression": "bf16"})
    path = write_config(tmp_path / "config.json", config)
    proc = torchrun("ddp_job.py", "--steps", "2", "--profile", "0:1", "--run-dir", str(tmp_path / "run"),
                    "--config", str(path), nproc=1, check=False)
    assert proc.returncode != 0
    assert f'{path} (knobs["gradient_compression"]): torch refused the bf16 compression hook' in proc.stderr


def lightning_fingerprint() -> str:
    holder = nn.Module()  # the LightningModule of lightning_job.py holds the model as `net`
    holder.net = get_example("mlp").build()
    return fingerprint(holder)


@pytest.mark.parametrize("package", ["lightning.pytorch", "pytorch_lightning"])
def test_lightning_job_applies_config(tmp_path, package):
    if importlib.util.find_spec(package.split(".")[0]) is None:
        pytest.skip(f"{package} is not installed")
    config = Config(fingerprint={"framework": "torch", "engine": "torch-ddp", "world_size": 2,
                                 "model": lightning_fingerprint()},
                    knobs={"torch.ddp.bucket_cap_mb": 0.25, "recompute": ["net"]})
    path = write_config(tmp_path / "config.json", config)
    run_dir = tmp_path / "run"
    run_job([sys.executable, str(JOBS / "lightning_job.py"), "--package", package, "--steps", "6",
             "--profile", "2:5", "--run-dir", str(run_dir), "--config", str(path)], timeout=240, cwd=tmp_path)
    run = load_prepared(run_dir)
    knobs = run.meta["knobs"]
    assert knobs["torch.ddp.bucket_cap_mb"] == 0.25 and knobs["lightning.strategy"] == "DDPStrategy"
    assert knobs["recompute"] == ["net"] and knobs["dpro.config"] == str(path)
    assert len(run.model["buckets"]) >= 3  # at DDP's default 25 MB (first bucket 1 MB): 2
    assert run.meta["model_fingerprint"] == config.fingerprint.model
    for rank in (0, 1):
        for step in (2, 3, 4):
            names = [e["name"] for e in events(run, rank, step)]
            assert names.count("FW.net.0") == 1 and names.count("RECOMPUTE.net.0") == 1, (rank, step)


def test_lightning_job_refuses_a_config_for_another_job(tmp_path):
    if importlib.util.find_spec("pytorch_lightning") is None:
        pytest.skip("pytorch_lightning is not installed")
    config = Config(fingerprint={"framework": "torch", "engine": "torch-ddp", "world_size": 2, "model": "0" * 16},
                    knobs={"torch.ddp.bucket_cap_mb": 0.25})
    path = write_config(tmp_path / "config.json", config)
    proc = run_job([sys.executable, str(JOBS / "lightning_job.py"), "--steps", "4", "--profile", "1:3",
                    "--run-dir", str(tmp_path / "run"), "--config", str(path)], timeout=240, check=False,
                   cwd=tmp_path)
    assert proc.returncode != 0 and "config was made for model 0000000000000000" in proc.stderr
    assert not (tmp_path / "run").exists()

