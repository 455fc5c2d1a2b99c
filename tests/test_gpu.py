"""The fast path on a GPU (README, "The GPU fast path"); skipped without CUDA. Every script runs with --cuda, with
--compile and with --cudagraphs; a CUDA graph computes what the same steps compute eagerly; no update waits for the
device; a run made on the GPU resumes on the CPU, and its model.pt loads on a machine without CUDA.
benchmark/gpu_check.sh runs this file and the speed table in one command."""

import subprocess
import sys

import pytest
import torch

from tests.conftest import SCRIPTS, TINY, flags_with, load_checkpoint, run_main
from tests.test_fast_path import fast_path_flags, recorded_steps

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def on_gpu(flags):
    return ["--cuda" if flag == "--no-cuda" else flag for flag in flags]


def without_compile(flags):
    return [flag for flag in flags if flag != "--compile"]


@pytest.mark.parametrize("mode", [[], ["--compile"], ["--cudagraphs"]], ids=["eager", "compile", "cudagraphs"])
@pytest.mark.parametrize("script", SCRIPTS)
def test_runs_3000_steps(script, mode, tmp_path, monkeypatch):
    flags = flags_with(
        on_gpu(TINY),
        total_timesteps=3000,
        learning_starts=1000,
        buffer_size=10000,
        eval_freq=1500,
        checkpoint_freq=3000,
    )
    result = run_main(
        script,
        flags + mode + (["--pop-size", "2", "--num-elites", "1"] if script == "erl_td3" else []),
        tmp_path,
        monkeypatch,
    )
    assert result["global_step"] >= 3000


@pytest.mark.parametrize("script", SCRIPTS)
def test_cuda_graphs_compute_what_eager_computes(script, tmp_path, monkeypatch):
    """20 updates replayed as CUDA graphs end within 1e-4 (each parameter tensor's difference, relative to its norm)
    of the same steps run eagerly (--compile with torch.compile as the identity: the buffer's length on the device,
    as the graphs have it); the tolerance is tests/test_fast_path.py's."""
    flags = on_gpu(without_compile(fast_path_flags(script)))
    with monkeypatch.context() as patch:
        patch.setattr(torch, "compile", lambda step: step)
        eager = run_main(script, flags + ["--compile"], tmp_path / "eager", monkeypatch)
    graphs = run_main(script, flags + ["--cudagraphs"], tmp_path / "graphs", monkeypatch)
    expected, actual = load_checkpoint(eager["run_dir"])["state"], load_checkpoint(graphs["run_dir"])["state"]
    for name, value in expected.items():
        if isinstance(value, dict) and all(isinstance(t, torch.Tensor) for t in value.values()):
            for key, tensor in value.items():
                difference = (actual[name][key] - tensor).norm() / tensor.norm().clamp(min=1e-12)
                assert difference < 1e-4, f"{name}.{key} differs by {difference:.2e} of its norm"


@pytest.mark.parametrize("script", SCRIPTS)
def test_no_update_waits_for_the_device(script, tmp_path, monkeypatch):
    """Each update step, called again with torch's sync debug mode at "error", never copies to the host or waits."""
    monkeypatch.setattr(torch, "compile", lambda step: step)
    steps, _ = recorded_steps(script, on_gpu(fast_path_flags(script)), tmp_path, monkeypatch)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for step in steps:
            step()
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.parametrize("script", SCRIPTS)
def test_a_gpu_run_resumes_on_the_cpu_and_its_model_loads_without_cuda(script, tmp_path, monkeypatch):
    flags = on_gpu(flags_with(TINY, checkpoint_freq=400)) + ["--save-model"]
    first = run_main(script, flags, tmp_path / "gpu", monkeypatch)
    checkpoint = f"{first['run_dir']}/checkpoint.pt"
    resumed = run_main(script, flags_with(TINY, total_timesteps=600, resume=checkpoint), tmp_path / "cpu", monkeypatch)
    assert resumed["global_step"] >= 600
    load = "import torch; model = torch.load({!r}, weights_only=False); print(sorted(model))"
    out = subprocess.run(
        [sys.executable, "-c", load.format(f"{first['run_dir']}/model.pt")],
        capture_output=True,
        text=True,
        env={"CUDA_VISIBLE_DEVICES": "", "PATH": "/usr/bin:/bin"},
    )
    assert out.returncode == 0, out.stderr
