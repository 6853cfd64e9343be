"""The amp and micro_batches knobs applied in one process (dpro.plugins.torch.apply, transformers_callback), and the
probe passes' guards of training state (dpro.plugins.torch.probes)."""

from __future__ import annotations

from typing import Any

import pytest

torch = pytest.importorskip("torch")

from torch import nn  # noqa: E402

from dpro.config import Config  # noqa: E402
from dpro.errors import ConfigError  # noqa: E402
from dpro.plugins.torch import apply  # noqa: E402
from dpro.plugins.torch.apply import amp_in_force, apply_amp, fingerprint, micro_batches_change  # noqa: E402
from dpro.plugins.torch.probes import batch_size, sliced, training_state_kept  # noqa: E402


def net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Dropout(0.5), nn.Linear(16, 4))


def test_amp_runs_the_forward_under_autocast_and_hands_back_fp32():
    model = net()
    inner: list[torch.dtype] = []
    model[0].register_forward_hook(lambda m, i, o: inner.append(o.dtype))
    config = Config(fingerprint={"framework": "torch", "engine": "torch-ddp", "world_size": 1,
                                 "model": fingerprint(model)}, knobs={"amp": "bf16"})
    apply(model, config)
    out = model(torch.randn(4, 8))
    assert inner == [torch.bfloat16] and out.dtype == torch.float32
    assert amp_in_force(model) == "bf16" and apply_amp(model, "bf16") == "bf16"  # twice: a no-op
    out.sum().backward()
    assert model[0].weight.grad.dtype == torch.float32  # parameters and gradients stay fp32


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


def test_fp16_loss_scaling_gives_the_unscaled_step_and_skips_an_overflow():
    x = torch.randn(4, 8)
    plain, scaled = mlp(), mlp()
    apply_amp(scaled, "fp16")
    scale = scaled._dpro_loss_scale
    try:
        opt_plain = torch.optim.SGD(plain.parameters(), lr=0.1)
        opt_scaled = torch.optim.SGD(scaled.parameters(), lr=0.1)
        # the first step at GradScaler's initial scale overflows fp16 (65536 is past its largest value): skipped,
        # the scale halved, the weights as they were
        before = scaled[0].weight.detach().clone()
        (scaled(x) ** 2).sum().backward()
        opt_scaled.step()
        assert torch.equal(scaled[0].weight, before) and scale.scale == 2.0**15
        scale.scale = 1024.0
        opt_scaled.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            reference = plain(x)
        (reference.float() ** 2).sum().backward()
        (scaled(x) ** 2).sum().backward()
        assert torch.allclose(scaled[0].weight.grad / 1024.0, plain[0].weight.grad, rtol=1e-2, atol=1e-4)
        opt_plain.step()
        opt_scaled.step()  # unscales first
        assert torch.allclose(scaled[0].weight, plain[0].weight, rtol=1e-3, atol=1e-4)
        assert scale.scale == 1024.0 and scale.clean == 1
    finally:
        scale.handle.remove()


def test_amp_refuses_an_unknown_precision():
    with pytest.raises(ConfigError, match='must be null, "bf16" or "fp16"'):
        apply_amp(net(), "int8")


def test_slices_cut_every_batch_tensor_and_leave_the_rest():
    batch = ((torch.zeros(8, 3),), {"mask": torch.ones(8, 2), "table": torch.ones(5), "n": 3})
    assert batch_size(batch) == 8
    args, kwargs = sliced(batch, 8, 2)
    assert args[0].shape == (2, 3) and kwargs["mask"].shape == (2, 2) and kwargs["table"].shape == (5,)
    assert kwargs["n"] == 3


def test_a_probe_leaves_gradients_buffers_and_the_rng_as_they_were():
    model = net()
    model(torch.randn(4, 8)).sum().backward()
    grad = model[0].weight.grad
    saved_grad = grad.clone()
    stats = model[1].running_mean.clone()
    rng = torch.get_rng_state()
    with training_state_kept(model):
        assert model[0].weight.grad is None
        model(torch.randn(16, 8) * 5).sum().backward()  # moves BatchNorm's statistics, draws dropout masks
    assert model[0].weight.grad is grad and torch.equal(grad, saved_grad)
    assert torch.equal(model[1].running_mean, stats) and torch.equal(torch.get_rng_state(), rng)


def test_micro_batches_in_a_trainer_and_the_change_a_plain_loop_needs():
    transformers = pytest.importorskip("transformers")
    from dpro.plugins.torch.transformers_callback import accumulate

    args = transformers.TrainingArguments(output_dir="unused", per_device_train_batch_size=8,
                                          gradient_accumulation_steps=2, use_cpu=True, report_to=[])
    accumulate(args, 4)  # the step's 16 samples in 4 passes
    assert (args.per_device_train_batch_size, args.gradient_accumulation_steps) == (4, 4)
    accumulate(args, 1)
    assert (args.per_device_train_batch_size, args.gradient_accumulation_steps) == (16, 1)
    with pytest.raises(ConfigError, match=r"1 batch\(es\) of 16 rows per optimizer step do not split into 3 equal"):
        accumulate(args, 3)
    assert "ddp_model.no_sync()" in micro_batches_change(2) and "(loss / 2).backward()" in micro_batches_change(2)
    assert "backward_passes_per_step=2" in micro_batches_change(2, horovod=True)
    assert "no_sync" not in micro_batches_change(2, horovod=True)


def test_compile_is_applied_in_place_and_falls_back_to_eager_when_compiling_fails():
    from dpro.plugins.torch.apply import apply_compile, compiled
    from dpro.plugins.torch.recorder import runs_compiled

    model, reference = mlp(), mlp()
    config = Config(fingerprint={"framework": "torch", "engine": "torch-ddp", "world_size": 1,
                                 "model": fingerprint(model)}, knobs={"compile": ["2"]})
    layer = model[2]
    apply(model, config)
    assert model[2] is layer and compiled(model) == ["2"] and apply_compile(model, ["2"]) == ["2"]  # twice: no-op
    assert runs_compiled(model, None) or not torch._dynamo.utils.counters["frames"]  # found once Dynamo ran

    def fails(*args, **kwargs):
        raise torch._dynamo.exc.TorchDynamoException("no C++ compiler")

    layer._dpro_compiled = fails  # what a failed compile raises, without compiling here
    x = torch.randn(4, 8)
    assert torch.equal(model(x), reference(x)) and compiled(model) == []  # eager from then on
    with pytest.raises(ConfigError, match="has no submodule 'nope'"):
        apply_compile(mlp(), ["nope"])


@pytest.mark.slow  # a real inductor build (seconds to tens of seconds on a CPU)
def test_compile_runs_the_model_compiled_with_eager_results():
    from dpro.plugins.torch.apply import apply_compile
    from dpro.plugins.torch.recorder import runs_compiled

    model, reference = mlp(), mlp()
    apply_compile(model, ["<root>"])
    x = torch.randn(4, 8)
    out = model(x)
    out.sum().backward()
    assert torch.allclose(out, reference(x), atol=1e-6) and model[0].weight.grad is not None
    assert runs_compiled(model, None)  # the recorder then leaves the modules untimed


@pytest.mark.slow  # a real inductor build
def test_a_backward_that_inductor_cannot_compile_runs_the_module_eager_from_its_forward():
    """Inductor compiles a backward when it first runs; a failure there would surface in the user's backward(). Here
    an op seen only in the backward has a lowering that fails (registered through inductor's own extension point):
    the compiled module's forward finds out, says so and runs eager, and the backward runs."""
    import torch._inductor.lowering as lowering

    from dpro.plugins.torch.apply import apply_compile, compiled

    def doubling_op(name: str) -> Any:
        """A custom op that doubles its input, with the fake kernel Dynamo traces it by."""
        op = torch.library.custom_op(f"dprotest::{name}", lambda x: x * 2, mutates_args=(),
                                     schema="(Tensor x) -> Tensor")
        op.register_fake(lambda x: torch.empty_like(x))
        return op

    doubling_op("scale_grad")  # seen only in the backward
    doubling_op("double").register_autograd(lambda ctx, g: torch.ops.dprotest.scale_grad(g))

    @lowering.register_lowering(torch.ops.dprotest.scale_grad.default)
    def _(g):
        raise RuntimeError("no lowering for this backward op")

    class Doubled(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = torch.nn.Linear(8, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.ops.dprotest.double(self.fc(x))

    model = Doubled()
    apply_compile(model, ["<root>"])
    out = model(torch.randn(4, 8))
    out.sum().backward()
    assert compiled(model) == [] and model.fc.weight.grad is not None
    assert torch.allclose(model.fc.bias.grad, torch.full((4,), 8.0))  # d/db sum(2 (Wx + b)) = 2 per row, 4 rows
