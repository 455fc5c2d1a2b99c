"""Golden runs: a tiny CPU run of each script (1 thread) must reproduce, bit for bit, the evaluation returns and the
final parameters recorded in tests/golden/{name}.json. Restructuring a script must not change what it computes;
a deliberate change of behaviour records the file again, and says why in its commit:

    GOLDEN_RECORD=1 python -m pytest tests/test_golden.py

Parameters are compared as a set of SHA-256 digests, one per floating-point tensor of the final checkpoint outside
its replay buffer and RNG states (networks, targets, optimiser moments, population, value bounds), so renaming or
regrouping them in the checkpoint does not matter, while changing any of their bits does. Float results depend on
the CPU's instruction set and the torch build: on a machine unlike the recording one the test is skipped, saying so.
"""

import csv
import hashlib
import json
import os
import platform
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.conftest import load_checkpoint, run_main

GOLDEN_DIR = Path(__file__).parent / "golden"
COMMON = ["--eval-episodes", "2", "--no-cuda", "--torch-threads", "1", "--seed", "3"]
# 1500 steps, learning from 500, evaluations every 500 and a checkpoint at the end.
SHORT = (
    "--total-timesteps 1500 --learning-starts 500 --batch-size 64 --eval-freq 500 --checkpoint-freq 1500 --log-freq 50"
)
# Two envs per vector step, the buffer wrapping around.
VECTOR = f"--env-id Hopper-v4 --num-envs 2 --buffer-size 1000 {SHORT}".split()
GOLDEN = {
    "td3_continuous": VECTOR,
    "sac_continuous": VECTOR,
    # Policy checkpoints with their switch to more episodes, several target cascades; the buffer for the offline run.
    "td7_continuous": (
        f"--env-id Hopper-v4 {SHORT} --target-update-rate 50 --steps-before-checkpointing 300 "
        "--max-eps-when-checkpointing 3 --save-buffer"
    ).split(),
    "sac_discrete": f"--env-id CartPole-v1 {SHORT}".split(),
    # Several generations with crossover, mutation, injection and learner updates.
    "erl_td3": (
        "--env-id Pendulum-v1 --total-timesteps 4000 --learning-starts 1000 --pop-size 4 --num-elites 1 "
        "--crossover-prob 0.5 --batch-size 64 --eval-freq 2000 --checkpoint-freq 4000"
    ).split(),
}
# TD7 offline, on the buffer that the td7_continuous golden run saved.
OFFLINE = "--offline --log-freq 50 --total-timesteps 200 --batch-size 64 --eval-freq 100 --checkpoint-freq 200".split()


def machine():
    """What float results depend on besides the code: the CPU, its instruction set as torch uses it, torch."""
    cpu = (
        next(
            (
                line.split(":", 1)[1].strip()
                for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")
            ),
            platform.processor(),
        )
        if Path("/proc/cpuinfo").exists()
        else ""
    )
    return f"{platform.machine()} {cpu} {torch.backends.cpu.get_cpu_capability()} torch {torch.__version__}"


def digests(tree, path=""):
    """SHA-256 of every floating-point tensor (of at least one dimension) in a checkpoint, outside "rb" and "rng"."""
    if isinstance(tree, dict):
        return [d for key, value in tree.items() if key not in ("rb", "rng") for d in digests(value, f"{path}.{key}")]
    if isinstance(tree, (list, tuple)):
        return [d for i, value in enumerate(tree) for d in digests(value, f"{path}[{i}]")]
    if isinstance(tree, torch.Tensor) and tree.is_floating_point() and tree.dim() > 0:
        t = tree.detach().cpu().contiguous()
        return [hashlib.sha256(str((t.dtype, tuple(t.shape))).encode() + t.numpy().tobytes()).hexdigest()]
    return []


def outcome(run_dir):
    """The evaluations (every column but the wall time) and the parameters' digests of a finished run."""
    with open(Path(run_dir) / "evaluations.csv") as f:
        evaluations = [[value for key, value in row.items() if key != "wall_time_s"] for row in csv.DictReader(f)]
    result = {"evaluations": evaluations, "parameters": sorted(set(digests(load_checkpoint(run_dir))))}
    if (Path(run_dir) / "buffer.npz").exists():
        with np.load(Path(run_dir) / "buffer.npz") as data:
            result["buffer"] = {k: hashlib.sha256(np.ascontiguousarray(data[k]).tobytes()).hexdigest() for k in data}
    return result


def check(name, result):
    path = GOLDEN_DIR / f"{name}.json"
    if os.environ.get("GOLDEN_RECORD"):
        GOLDEN_DIR.mkdir(exist_ok=True)
        path.write_text(json.dumps({"machine": machine(), **result}, indent=1) + "\n")
        return
    golden = json.loads(path.read_text())
    if golden["machine"] != machine():
        pytest.skip(f"golden results were recorded on {golden['machine']}; this is {machine()}")
    assert result["evaluations"] == golden["evaluations"]
    missing = set(golden["parameters"]) - set(result["parameters"])
    assert not missing, f"{len(missing)} of {len(golden['parameters'])} parameter tensors differ from the golden run"
    assert result.get("buffer") == golden.get("buffer")


@pytest.mark.parametrize("script", GOLDEN)
def test_golden_run(script, tmp_path, monkeypatch):
    run = run_main(script, COMMON + GOLDEN[script], tmp_path / "online", monkeypatch)
    check(script, outcome(run["run_dir"]))
    if script == "td7_continuous":
        offline = run_main(
            script,
            COMMON + OFFLINE + ["--env-id", "Hopper-v4", "--dataset", str(Path(run["run_dir"]) / "buffer.npz")],
            tmp_path / "offline",
            monkeypatch,
        )
        check("td7_continuous_offline", outcome(offline["run_dir"]))
