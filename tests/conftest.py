"""Helpers shared by the tests: how to run a script in-process or through its real command line."""

import importlib
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import tyro

REPO = Path(__file__).resolve().parent.parent
# A few hundred steps with updates, checkpoints and one short evaluation: every code path, in seconds.
TINY = [
    "--total-timesteps",
    "400",
    "--learning-starts",
    "200",
    "--batch-size",
    "32",
    "--buffer-size",
    "1000",
    "--eval-freq",
    "200",
    "--eval-episodes",
    "2",
    "--checkpoint-freq",
    "200",
    "--no-cuda",
    "--torch-threads",
    "1",
]
CONTINUOUS_SCRIPTS = ["td3_continuous", "td7_continuous", "sac_continuous", "erl_td3"]
# Each script with its default env; the common tests run over all of them.
DEFAULT_ENV = {**{script: "Hopper-v4" for script in CONTINUOUS_SCRIPTS}, "sac_discrete": "CartPole-v1"}
SCRIPTS = list(DEFAULT_ENV)
# How a script runs two training envs at once (TD7's checkpoints judge whole episodes of one policy; ERL has one
# env per individual).
TWO_ENV_FLAGS = {
    "td7_continuous": ["--num-envs", "2", "--no-checkpoints"],
    "erl_td3": ["--pop-size", "2", "--num-elites", "1"],
}


def flags_with(flags, **overrides):
    """`flags` with some --name value pairs replaced or added: flags_with(TINY, total_timesteps=200)."""
    flags = list(flags)
    for name, value in overrides.items():
        flag = "--" + name.replace("_", "-")
        if flag in flags:
            flags[flags.index(flag) + 1] = str(value)
        else:
            flags += [flag, str(value)]
    return flags


def toy_env(script, name):
    """The --env-id of a toy env from tests/toy_envs.py, with the action space `script` takes."""
    return f"tests.toy_envs:{'Discrete' if script == 'sac_discrete' else ''}{name}"


def cli_env():
    return dict(os.environ, MUJOCO_GL="egl", WANDB_MODE="offline", WANDB_SILENT="true")


def run_cli(script, flags, cwd, timeout=900):
    """Run `python {script}.py {flags}` in `cwd`, as a user would; returns the CompletedProcess."""
    return subprocess.run(
        [sys.executable, str(REPO / f"{script}.py"), *flags],
        cwd=cwd,
        env=cli_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def run_main(script, flags, cwd, monkeypatch):
    """Parse `flags` with the script's own tyro parser and call its main() in-process, inside `cwd`."""
    Path(cwd).mkdir(parents=True, exist_ok=True)
    monkeypatch.chdir(cwd)
    module = importlib.import_module(script)
    threads = torch.get_num_threads()  # --torch-threads is process-wide: keep it from leaking into other tests
    try:
        return module.main(tyro.cli(module.Args, args=list(flags)))
    finally:
        torch.set_num_threads(threads)


def load_checkpoint(run_dir):
    """A run's checkpoint.pt; its step as "global_step" also where the loop's values are kept by name ("loop")."""
    checkpoint = torch.load(Path(run_dir) / "checkpoint.pt", map_location="cpu", weights_only=False)
    if "loop" in checkpoint:
        checkpoint["global_step"] = checkpoint["loop"]["global_step"]
    return checkpoint


@pytest.fixture(scope="session")
def tiny_runs(tmp_path_factory):
    """One tiny run of each script through the command line, made once and shared by the tests that read it."""
    runs = {}

    def get(script):
        if script not in runs:
            cwd = tmp_path_factory.mktemp(script)
            result = run_cli(script, TINY + ["--save-model"], cwd)
            assert result.returncode == 0, result.stderr
            (run_dir,) = (cwd / "runs").iterdir()
            runs[script] = run_dir
        return runs[script]

    return get
