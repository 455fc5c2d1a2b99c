"""The fast path on a GPU (docs/fast_path.md); skipped without CUDA. Every script runs with --cuda, eagerly, with
--compile, --cudagraphs and both; a CUDA graph computes what the same steps compute eagerly; no update waits for the
device, compiled or not; TD7's exact sampling stays exact under --compile; discrete SAC's Atari frames are stored
without a wait and sampled exactly; a run made on the GPU resumes on the CPU, and its model.pt loads without CUDA.
Without a flag a GPU run replays CUDA graphs (--no-cudagraphs: eager).
The runs use benchmark/speed.py's workload shapes, so that benchmark/gpu_check.sh compiles each update once for these
tests and its speed table."""

import importlib
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import sac_discrete
from benchmark.speed import workload_flags
from tests.conftest import SCRIPTS, TINY, flags_with, load_checkpoint, run_main
from tests.test_fast_path import fast_path_flags
from tests.test_td7 import filled_buffer

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def on_gpu(flags):
    return ["--cuda" if flag == "--no-cuda" else flag for flag in flags]


def without_compile(flags):
    return [flag for flag in flags if flag != "--compile"]


@pytest.mark.parametrize("mode", ["eager", "cudagraphs", "compile+cudagraphs"])  # --compile alone: the sync test
@pytest.mark.parametrize("script", SCRIPTS)
def test_runs_500_updates_evaluates_and_checkpoints(script, mode, tmp_path, monkeypatch):
    flags = flags_with(workload_flags(script, "cuda", 500, mode=mode), eval_freq=750, checkpoint_freq=1500)
    result = run_main(script, flags, tmp_path, monkeypatch)
    assert result["global_step"] >= 1500
    assert load_checkpoint(result["run_dir"])["loop"]["global_step"] >= 1500


@pytest.mark.parametrize("script", SCRIPTS)
def test_cuda_graphs_compute_what_eager_computes(script, tmp_path, monkeypatch):
    """20 updates replayed as CUDA graphs end within 1e-4 (each parameter tensor's difference, relative to its norm)
    of the same steps run eagerly (--compile with torch.compile as the identity: the buffer's length on the device,
    as the graphs have it); the tolerance is tests/test_fast_path.py's."""
    flags = on_gpu(without_compile(fast_path_flags(script)))
    with monkeypatch.context() as patch:
        patch.setattr(torch, "compile", lambda step: step)
        eager = run_main(script, flags + ["--compile", "--no-cudagraphs"], tmp_path / "eager", monkeypatch)
    graphs = run_main(script, flags + ["--cudagraphs"], tmp_path / "graphs", monkeypatch)
    expected, actual = load_checkpoint(eager["run_dir"])["state"], load_checkpoint(graphs["run_dir"])["state"]
    for name, value in expected.items():
        if isinstance(value, dict) and all(isinstance(t, torch.Tensor) for t in value.values()):
            for key, tensor in value.items():
                difference = (actual[name][key] - tensor).norm() / tensor.norm().clamp(min=1e-12)
                assert difference < 1e-4, f"{name}.{key} differs by {difference:.2e} of its norm"


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compile"])
@pytest.mark.parametrize("script", SCRIPTS)
def test_no_update_waits_for_the_device(script, compiled, tmp_path, monkeypatch):
    """Each update step as the run built it, called again with torch's sync debug mode at "error", never copies to
    the host or waits: eagerly, and compiled with the workload's shapes (those the speed table compiles)."""
    module = importlib.import_module(script)
    accelerate, steps = module.accelerate, []
    monkeypatch.setattr(module, "accelerate", lambda step, args: steps.append(accelerate(step, args)) or steps[-1])
    if not compiled:
        monkeypatch.setattr(torch, "compile", lambda step: step)
    flags = workload_flags(script, "cuda", 40, mode="compile") if compiled else on_gpu(fast_path_flags(script))
    flags = flags + ["--no-cudagraphs"]  # the steps themselves, not a graph of them
    run_main(script, flags, tmp_path, monkeypatch)
    for step in steps:
        step()  # compiled by now, and the optimizers' state made
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for step in steps:
            step()
    finally:
        torch.cuda.set_sync_debug_mode("default")


def test_td7_exact_sampling_stays_exact_under_compile():
    """A deterministic GPU run draws LAP's rows by integers, compiled too: a row of 2**-25 of the total priority is
    drawn about 32 times in 2**30 draws. A float64 draw, which inductor makes from float32 random numbers, lands on
    a grid of 2**24 points, and that row, the last of the ring, is never drawn."""
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        rb = filled_buffer(n=2, capacity=2, batch_size=2**26, device="cuda")
        assert rb.exact
        rb.priority.copy_(torch.tensor([2.0**25 - 1, 1.0]))
        sample = torch.compile(rb.sample)
        hits = 0
        for _ in range(16):
            sample()
            hits += int(rb.idx.sum())  # the draws of row 1
    finally:
        torch.use_deterministic_algorithms(False)
    assert 8 <= hits <= 70, hits  # Poisson(32): outside this range with probability below 1e-6


def test_atari_frames_are_stored_without_waiting_and_sampled_the_same_twice():
    """Discrete SAC's frame buffer on the GPU: a vector step is stored from one asynchronous upload, with no wait on
    the device; the exact integer sampling gives the same batch from the same seed, in deterministic mode."""
    device = torch.device("cuda")
    rb = sac_discrete.FrameReplayBuffer(1000, (4, 84, 84), 2, 256, device)
    obs = np.random.default_rng(0).integers(0, 255, (2, 4, 84, 84), dtype=np.uint8)
    rewards, zeros = np.ones(2, np.float32), np.zeros(2, np.float32)
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        rb.add(obs, np.array([1, 2]), rewards, zeros, obs, [False, False])  # the first call's allocations
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            for step in range(50):
                rb.add(obs, np.array([1, 2]), rewards, zeros, obs, [False, step == 20])
                rb.sample()
        finally:
            torch.cuda.set_sync_debug_mode("default")
        torch.manual_seed(0)
        first = rb.sample()
        torch.manual_seed(0)
        assert all(torch.equal(x, y) for x, y in zip(first, rb.sample()))
    finally:
        torch.use_deterministic_algorithms(False)


def test_a_gpu_run_resumes_on_the_cpu_and_its_model_loads_without_cuda(tmp_path, monkeypatch):
    """At the defaults on a GPU (CUDA graphs, as args.json records), then resumed on the CPU (eager)."""
    for script in SCRIPTS:
        flags = on_gpu(flags_with(TINY, checkpoint_freq=400)) + ["--save-model"]
        first = run_main(script, flags, tmp_path / script / "gpu", monkeypatch)
        assert json.loads((Path(first["run_dir"]) / "args.json").read_text())["cudagraphs"] is True
        checkpoint = f"{first['run_dir']}/checkpoint.pt"
        resumed = run_main(
            script, flags_with(TINY, total_timesteps=600, resume=checkpoint), tmp_path / script / "cpu", monkeypatch
        )
        assert resumed["global_step"] >= 600
        load = "import torch; model = torch.load({!r}, weights_only=False); print(sorted(model))"
        out = subprocess.run(
            [sys.executable, "-c", load.format(f"{first['run_dir']}/model.pt")],
            capture_output=True,
            text=True,
            env={"CUDA_VISIBLE_DEVICES": "", "PATH": "/usr/bin:/bin"},
        )
        assert out.returncode == 0, f"{script}: {out.stderr}"
