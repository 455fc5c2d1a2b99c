"""The fast path on the CPU (docs/fast_path.md): the update steps that --compile compiles and --cudagraphs
captures run on the meta device (so nothing in them reads a value back to the host), keep every tensor they touch in
one place in memory (a CUDA graph replays fixed addresses), --compile
computes what eager computes within float rounding, and it compiles once: no recompile as the buffer fills and wraps,
and graph breaks only where torch always breaks (backward, the optimizer). tests/test_gpu.py does the rest on a GPU.
"""

import copy
import importlib
from functools import partial

import pytest
import torch
import torch._dynamo.utils
import torch._inductor.config

from tests.conftest import ERL_SMALL, SCRIPTS, TINY, flags_with, load_checkpoint, run_main

# Learning starts at 200 steps; 20 updates later the run ends. The buffer (150 rows) is full before learning starts
# and wraps while the steps run, so its length stops changing only after a wrap: a recompile would show.
TWENTY_UPDATES = flags_with(TINY, total_timesteps=220, buffer_size=150, eval_freq=0, checkpoint_freq=220)
# Graph breaks torch makes in any update (backward and the optimizer's step); any other would be ours.
ALLOWED_BREAKS = ("backward", "Optimizer", "optimizer", "fused", "torch._dynamo.graph_break()")


def fast_path_flags(script):
    """The flags of these tests for `script`, --compile among them."""
    if script == "erl_td3":  # ERL updates after each generation: on Pendulum (200-step episodes) 3 episodes with 2
        # individuals and a learner, 30 updates after the first, 30 after the second, the buffer's length changed
        # and wrapped by then. ERL has no --log-freq: it logs once a generation.
        return flags_with(
            TWENTY_UPDATES,
            env_id="Pendulum-v1",
            **ERL_SMALL,
            utd_ratio=0.05,
            total_timesteps=1200,
            buffer_size=1000,
            checkpoint_freq=1200,
        ) + ["--compile"]
    # TD7 without its policy checkpoints updates at every step, as the others, instead of in bursts at episode ends.
    return (
        TWENTY_UPDATES
        + ["--log-freq", "10", "--compile"]
        + (["--no-checkpoints"] if script == "td7_continuous" else [])
    )


def recorded_steps(script, flags, tmp_path, monkeypatch):
    """Run `script` with `flags` and return the update steps its main built through `accelerate`, after the run."""
    module, steps = importlib.import_module(script), []
    accelerate = module.accelerate

    def recording(step, args):
        steps.append(step)
        return accelerate(step, args)

    monkeypatch.setattr(module, "accelerate", recording)
    run = run_main(script, flags, tmp_path, monkeypatch)
    return steps, run


def tensors_of(obj, seen=None):
    """Every tensor an update step can reach through its bound arguments: parameters, module buffers, optimizer
    state, a replay buffer's tensors, and tensors held directly or in lists, dicts and plain objects."""
    seen = set() if seen is None else seen
    if id(obj) in seen:
        return []
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, torch.nn.Module):
        return list(obj.parameters()) + list(obj.buffers())
    if isinstance(obj, torch.optim.Optimizer):
        return [t for state in obj.state.values() for t in state.values() if isinstance(t, torch.Tensor)]
    if isinstance(obj, (list, tuple)):
        return [t for item in obj for t in tensors_of(item, seen)]
    if isinstance(obj, dict):
        return [t for item in obj.values() for t in tensors_of(item, seen)]
    if hasattr(obj, "func") and hasattr(obj, "args"):  # functools.partial
        return tensors_of(list(obj.args) + list(obj.keywords.values()), seen)
    if hasattr(obj, "__dict__") and type(obj).__module__ not in ("builtins",) and not callable(obj):
        return tensors_of(vars(obj), seen)
    return []


@pytest.mark.parametrize("script", SCRIPTS)
def test_update_steps_keep_their_tensors_in_place(script, tmp_path, monkeypatch):
    """After a warm-up call, three more calls of every update step leave every tensor it can reach at its address,
    unreplaced: a CUDA graph captured at the first of them would otherwise read stale memory. (--compile with
    torch.compile as the identity: the steps as --cudagraphs would capture them, the buffer's length on the device.)"""
    monkeypatch.setattr(torch, "compile", lambda step: step)
    steps, _ = recorded_steps(script, fast_path_flags(script), tmp_path, monkeypatch)
    assert steps
    for step in steps:
        step()  # a warm-up call, as before a capture: the optimizers' state exists from here on
        before = {id(t): t.data_ptr() for t in tensors_of(step)}
        for _ in range(3):
            step()
        after = {id(t): t.data_ptr() for t in tensors_of(step)}
        assert after == before, f"{step.func.__name__} replaces or moves a tensor it keeps"


@pytest.mark.parametrize("script", SCRIPTS)
def test_update_steps_run_on_the_meta_device(script, tmp_path, monkeypatch):
    """Every update step, with every tensor it reaches moved to the meta device (shapes, no values), runs: it
    reads no value back to the host (no .item(), no Python branch on a tensor), which on a GPU would wait for it."""
    monkeypatch.setattr(torch, "compile", lambda step: step)
    steps, _ = recorded_steps(script, fast_path_flags(script), tmp_path, monkeypatch)
    for step in steps:
        step()  # the optimizers' state exists from here on
        meta = {
            id(t): (torch.nn.Parameter if isinstance(t, torch.nn.Parameter) else torch.Tensor.requires_grad_)(
                t.detach().to("meta"), t.requires_grad
            )
            for t in tensors_of(step)
        }
        bound = copy.deepcopy(list(step.args), meta)  # the networks, optimizers and buffer, on tensors of `meta`
        for obj in bound:
            if not isinstance(obj, torch.Tensor) and isinstance(getattr(obj, "device", None), torch.device):
                obj.device = torch.device("meta")  # a buffer's own device
        outputs = partial(step.func, *bound)()  # a tensor, a tuple or dict of them, or None (a target update)
        outputs = (
            outputs.values() if isinstance(outputs, dict) else outputs if isinstance(outputs, tuple) else [outputs]
        )
        assert all(output.device.type == "meta" for output in outputs if output is not None)


@pytest.mark.parametrize("script", SCRIPTS)
def test_compile_matches_eager_and_compiles_once(script, tmp_path, monkeypatch):
    """20 updates with --compile end within 1e-4 of the same steps run eagerly (the norm of each parameter tensor's
    difference, relative to its norm), with no recompile after the first updates while the buffer wraps, and graph
    breaks only at backward and the optimizer. Eager here is --compile with torch.compile as the identity (the
    buffer's length on the device, as compiled), and compiled code draws its random numbers as eager does (inductor's
    fallback_random; by default it has its own generator: other batches and noise, as good but not comparable). The
    tolerance, measured on TD3 and TD7: float32 rounding of reordered sums left at most 2e-6 of the norm (a few
    elements moved by up to ~1e-5: Adam's step normalises a near-zero gradient), while other batches and noise (the
    compiled code's own random numbers) moved the most-moved tensor by 2e-2 to 4e-2 of its norm."""
    flags = fast_path_flags(script)
    with monkeypatch.context() as patch:
        patch.setattr(torch, "compile", lambda step: step)
        eager = run_main(script, flags, tmp_path / "eager", monkeypatch)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    module, graphs = importlib.import_module(script), []
    record = module.Metrics.record

    def counting(self, global_step, update, **metrics):
        graphs.append(torch._dynamo.utils.counters["stats"]["unique_graphs"])
        return record(self, global_step, update, **metrics)

    monkeypatch.setattr(module.Metrics, "record", counting)
    # torch's own patch of its config: some pytest releases' monkeypatch deletes a config entry when it restores it
    with torch._inductor.config.patch(fallback_random=True):
        compiled = run_main(script, flags, tmp_path / "compiled", monkeypatch)
    assert graphs[-1] == graphs[5], f"recompiled after update 5: {graphs[5]} graphs then, {graphs[-1]} at the end"
    breaks = [reason.splitlines()[0] + " " + reason for reason in torch._dynamo.utils.counters["graph_break"]]
    assert all(any(word in reason for word in ALLOWED_BREAKS) for reason in breaks), breaks
    expected, actual = load_checkpoint(eager["run_dir"])["state"], load_checkpoint(compiled["run_dir"])["state"]
    compared = 0
    for name, value in expected.items():
        if isinstance(value, dict) and all(isinstance(t, torch.Tensor) for t in value.values()):  # a network
            for key, tensor in value.items():
                difference = (actual[name][key] - tensor).norm() / tensor.norm().clamp(min=1e-12)
                assert difference < 1e-4, f"{name}.{key} differs by {difference:.2e} of its norm"
                compared += 1
    assert compared
