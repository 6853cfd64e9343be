"""Profiler in one process (no DDP): wrong arguments get clear errors; a plain loop is recorded."""

from __future__ import annotations

import copy as copy_module
import functools
import json

import pytest

torch = pytest.importorskip("torch")

from dpro.errors import UsageError  # noqa: E402
from dpro.io.load import load_run  # noqa: E402
from dpro.plugins.torch import Profiler  # noqa: E402


def small_model() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))


def train(prof: Profiler, model: torch.nn.Module, opt: torch.optim.Optimizer, steps: int) -> None:
    for _ in range(steps):
        opt.zero_grad()
        model(torch.randn(4, 8)).sum().backward()
        opt.step()
        prof.step()


def test_plain_loop_without_ddp(tmp_path):
    model = small_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with Profiler(model, opt, run_dir=tmp_path / "run", steps=range(1, 3)) as prof:
        train(prof, model, opt, 5)
    run = load_run(tmp_path / "run")
    assert run.meta["engine"] == "torch" and run.ranks[0].steps == [1, 2]
    names = {e["name"] for e in run.ranks[0].events}
    assert {"FW.0", "FW.1", "FW.2", "BW.0", "BW.2", "UPDATE.optimizer", "STEP", "IO.batch"} <= names
    assert not any(e["cat"] == "COMM" for e in run.ranks[0].events)


def bw_events(run_dir) -> dict[int, dict[str, dict]]:
    out: dict[int, dict[str, dict]] = {}
    for e in load_run(run_dir).ranks[0].events:
        if e["cat"] == "BW":
            out.setdefault(e["args"]["step"], {})[e["name"]] = e
    return out


def test_backward_from_gradient_marks_covers_every_module_and_tensor_hooks_time_each(tmp_path):
    original = torch.autograd.backward
    model = small_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with Profiler(model, opt, run_dir=tmp_path / "grads", steps=range(1, 4)) as prof:
        train(prof, model, opt, 2)
        assert torch.autograd.backward is not original  # the pass's start is marked while recording
        train(prof, model, opt, 3)
    assert torch.autograd.backward is original
    for step, bw in bw_events(tmp_path / "grads").items():
        assert set(bw) == {"BW.0", "BW.1", "BW.2"}, step
        # backward order, back to back: each module from the gradients of the one before it to its own
        assert bw["BW.2"]["ts"] + bw["BW.2"]["dur"] == pytest.approx(bw["BW.1"]["ts"], abs=0.01)
        assert bw["BW.1"]["ts"] + bw["BW.1"]["dur"] == pytest.approx(bw["BW.0"]["ts"], abs=0.01)
        end = bw["BW.0"]["ts"] + bw["BW.0"]["dur"]
        assert end == pytest.approx(max(bw["BW.0"]["args"]["grads_ready_us"]), abs=0.01)
        assert "estimated" in bw["BW.1"]["args"] and "estimated" in bw["BW.0"]["args"]  # the ReLU shares BW.0's span
        assert "estimated" not in bw["BW.2"]["args"] and sorted(bw["BW.2"]["args"]["grads"]) == ["2.bias", "2.weight"]
    with Profiler(model, opt, run_dir=tmp_path / "tensors", steps=range(1, 3), backward_marks="tensors") as prof:
        train(prof, model, opt, 3)
    for bw in bw_events(tmp_path / "tensors").values():
        assert set(bw) == {"BW.0", "BW.1", "BW.2"} and not any("estimated" in e["args"] for e in bw.values())
    with pytest.raises(UsageError, match="backward_marks"):
        Profiler(model, opt, run_dir=tmp_path / "bad", backward_marks="hooks")


def test_hooks_are_removed_outside_the_window(tmp_path):
    model = small_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    linear_forward, relu_forward = torch.nn.Linear.forward, torch.nn.ReLU.forward
    with Profiler(model, opt, run_dir=tmp_path / "run", steps=range(1, 2)) as prof:
        assert torch.nn.Linear.forward is linear_forward
        train(prof, model, opt, 1)  # step 1 opens at the end of step 0: its forwards run through timed class forwards
        assert torch.nn.Linear.forward is not linear_forward and torch.nn.ReLU.forward is not relu_forward
        copy = copy_module.deepcopy(model)  # a copy made while recording (an EMA model) runs as itself, untimed
        with torch.no_grad():
            for p in copy.parameters():
                p.zero_()
        assert not copy(torch.ones(2, 8)).any() and model(torch.ones(2, 8)).any()
        train(prof, model, opt, 2)
        assert torch.nn.Linear.forward is linear_forward and torch.nn.ReLU.forward is relu_forward
        assert not model[0]._forward_hooks and not model[0]._forward_pre_hooks and not model[0]._backward_hooks
    fw = [e for e in json.loads((tmp_path / "run" / "rank-0.json").read_text())["traceEvents"]
          if e.get("cat") == "FW"]
    # step 1: the training forward, and the model's own call beside the copy's (the copy's is not there)
    assert sorted(e["name"] for e in fw) == ["FW.0", "FW.0", "FW.1", "FW.1", "FW.2", "FW.2"]


def test_inherited_and_instance_forwards_are_timed_once_and_a_scripted_module_is_left_alone(tmp_path):
    class Wider(torch.nn.Linear):  # inherits Linear's forward: timed by the wrapper of its own class, not twice
        pass

    own = torch.nn.Linear(8, 8)
    own.forward = functools.partial(torch.nn.Linear.forward, own)  # a forward of the instance's own: module hooks
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), Wider(8, 8), own, torch.jit.script(torch.nn.Linear(8, 2)))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with Profiler(model, opt, run_dir=tmp_path / "run", steps=range(1, 3)) as prof:
        train(prof, model, opt, 3)
    assert torch.nn.Linear.forward is Wider.forward and "forward" not in Wider.__dict__
    assert not own._forward_hooks and not own._forward_pre_hooks
    names = [e["name"] for e in json.loads((tmp_path / "run" / "rank-0.json").read_text())["traceEvents"]
             if e.get("cat") == "FW"]
    assert sorted(names) == ["FW.0", "FW.0", "FW.1", "FW.1", "FW.2", "FW.2"]  # the scripted module has none


def test_model_without_parameters_is_refused(tmp_path):
    with pytest.raises(UsageError, match="no trainable parameters"):
        Profiler(torch.nn.ReLU(), None, run_dir=tmp_path / "run")


def test_run_dir_that_is_a_file_is_refused(tmp_path):
    path = tmp_path / "file"
    path.write_text("x")
    with pytest.raises(UsageError, match="is a file"):
        Profiler(small_model(), None, run_dir=path)


def test_non_empty_run_dir_is_refused(tmp_path):
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "rank-0.json").write_text("{}")
    with pytest.raises(UsageError, match="never overwrites"):
        Profiler(small_model(), None, run_dir=tmp_path / "run")


def test_steps_beyond_the_run_are_refused_up_front(tmp_path):
    with pytest.raises(UsageError, match="only 10 steps"):
        Profiler(small_model(), None, run_dir=tmp_path / "run", steps=range(5, 15), total_steps=10)


@pytest.mark.parametrize("steps,match", [(range(0), "empty"), ([-1, 2], "negative"), (["a"], "integers")])
def test_bad_windows(tmp_path, steps, match):
    with pytest.raises(UsageError, match=match):
        Profiler(small_model(), None, run_dir=tmp_path / "run", steps=steps)


def test_window_never_reached_is_an_error(tmp_path):
    model = small_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(UsageError, match="never reached"):
        with Profiler(model, opt, run_dir=tmp_path / "run", steps=range(50, 60)) as prof:
            train(prof, model, opt, 3)


def test_default_run_dir_is_new_and_timestamped(tmp_path, monkeypatch):
    monkeypatch.setenv("DPRO_RUN_DIR", str(tmp_path / "runs"))
    dirs = []
    for _ in range(2):
        model = small_model()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        with Profiler(model, opt, steps=range(0, 1)) as prof:
            train(prof, model, opt, 1)
        dirs.append(prof.run_dir)
    assert dirs[0] != dirs[1] and all(d.parent == tmp_path / "runs" for d in dirs)


def test_closure_work_is_not_update(tmp_path):
    """optimizer.step(closure) (LBFGS calls it several times): forwards and backwards inside the closure are
    recorded as FW/BW, each call a micro-batch of its own, and UPDATE starts after the last one."""
    model = small_model()
    opt = torch.optim.LBFGS(model.parameters(), lr=0.1, max_iter=3)
    x = torch.randn(4, 8)

    def closure():
        opt.zero_grad()
        loss = model(x).pow(2).sum()
        loss.backward()
        return loss

    with Profiler(model, opt, run_dir=tmp_path / "run", steps=range(1, 3)) as prof:
        for _ in range(4):
            opt.step(closure)
            prof.step()
    trace = load_run(tmp_path / "run").ranks[0]
    for step in trace.steps:
        events = [e for e in trace.events if e["args"]["step"] == step]
        (update,) = [e for e in events if e["cat"] == "UPDATE"]
        fws = [e for e in events if e["name"] == "FW.0"]
        assert len(fws) >= 2  # LBFGS evaluated the closure more than once
        assert len([e for e in events if e["name"] == "BW.0"]) == len(fws)
        assert all(e["ts"] + e["dur"] <= update["ts"] + 1.0 for e in events if e["cat"] in ("FW", "BW"))


def test_evaluation_inside_a_step_is_not_recorded(tmp_path):
    """A loop that evaluates (eval mode, no_grad) between training steps: only the training forwards are FW."""
    model = small_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with Profiler(model, opt, run_dir=tmp_path / "run", steps=range(1, 3)) as prof:
        for _ in range(4):
            model.eval()
            with torch.no_grad():
                model(torch.randn(4, 8))
            model.train()
            opt.zero_grad()
            model(torch.randn(4, 8)).sum().backward()
            opt.step()
            prof.step()
    trace = load_run(tmp_path / "run").ranks[0]
    for step in trace.steps:
        names = [e["name"] for e in trace.events if e["args"]["step"] == step]
        assert names.count("FW.0") == 1 and names.count("BW.0") == 1, names
