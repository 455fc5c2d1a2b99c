"""Helpers shared by the tests: how to run a script in-process or through its real command line."""

import contextlib
import importlib
import io
import os
import re
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
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
# ERL's smallest population, for the cases that are not about the population: 2 individuals (one of them the elite)
# beside the learner, so that a generation is 3 episodes, not the default's 11 (flags_with(flags, **ERL_SMALL)).
ERL_SMALL = {"pop_size": 2, "num_elites": 1}


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


# How a script runs two training envs at once (TD7's checkpoints judge whole episodes of one policy; ERL has one
# env per individual).
TWO_ENV_FLAGS = {
    "td7_continuous": ["--num-envs", "2", "--no-checkpoints"],
    "erl_td3": flags_with([], **ERL_SMALL),
}


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


def start_cli(script, flags, cwd, **env):
    """Start `python {script}.py {flags}` in `cwd` as run_cli does, without waiting; its stdout and stderr are pipes."""
    return subprocess.Popen(
        [sys.executable, str(REPO / f"{script}.py"), *flags],
        cwd=cwd,
        env={**cli_env(), **env},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def signal_when(proc, ready, signum=signal.SIGTERM, settle=0.0, within=None):
    """Send `signum` to a started run once `ready()` holds (and `settle` seconds later); it must exit with 128 +
    signum, within `within` seconds of the signal when given. Returns its stderr."""
    deadline = time.time() + 300
    while not ready() and time.time() < deadline:
        time.sleep(0.05)
    time.sleep(settle)
    sent = time.time()
    proc.send_signal(signum)
    _, stderr = proc.communicate(timeout=60)
    if within is not None:
        assert time.time() - sent < within, stderr
    assert proc.returncode == 128 + signum, stderr
    return stderr


def assert_same(a, b, path="checkpoint"):
    """Recursive bit-for-bit equality of two checkpoint trees (tensors, arrays, dicts, lists, numbers)."""
    assert type(a) is type(b), path
    if isinstance(a, dict):
        assert a.keys() == b.keys(), path
        for key in a:
            assert_same(a[key], b[key], f"{path}.{key}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{path}[{i}]")
    elif isinstance(a, torch.Tensor):
        assert torch.equal(a, b), path
    elif isinstance(a, np.ndarray):
        assert np.array_equal(a, b), path
    else:
        assert a == b, path


def run_main(script, flags, cwd, monkeypatch):
    """Parse `flags` with the script's own tyro parser and call its main() in-process, inside `cwd`; with --resume,
    the checkpoint's arguments are the defaults, as on the command line (a CPU run records --cudagraphs as false)."""
    Path(cwd).mkdir(parents=True, exist_ok=True)
    monkeypatch.chdir(cwd)
    module = importlib.import_module(script)
    args = tyro.cli(module.Args, args=list(flags))
    if args.resume:  # as the scripts' `__main__` does
        saved = module.read_checkpoint(args.resume)["args"]
        default = module.Args(**{k: saved[k] for k in module.Args.__dataclass_fields__ if k in saved})
        args = tyro.cli(module.Args, args=list(flags), default=default)
    threads = torch.get_num_threads()  # --torch-threads is process-wide: keep it from leaking into other tests
    try:
        return module.main(args)
    finally:
        torch.set_num_threads(threads)


def load_checkpoint(run_dir):
    """A run's checkpoint.pt; its step as "global_step" also where the loop's values are kept by name ("loop")."""
    checkpoint = torch.load(Path(run_dir) / "checkpoint.pt", map_location="cpu", weights_only=False)
    if "loop" in checkpoint:
        checkpoint["global_step"] = checkpoint["loop"]["global_step"]
    return checkpoint


def logged_losses(run_dir):
    """The losses/ scalars of a run's TensorBoard files, as (step, value) pairs per tag."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir))
    events.Reload()
    tags = [tag for tag in events.Tags()["scalars"] if tag.startswith("losses/")]
    return {tag: [(event.step, event.value) for event in events.Scalars(tag)] for tag in tags}


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


@pytest.fixture
def host_memory(monkeypatch):
    """The host's free memory as the memory check reads it (/proc/meminfo, no cgroup), set through the returned
    dict's "free" (bytes), so that a test of the check does not depend on the machine it runs on."""
    memory = {"free": 0}
    opened = open

    def fake_open(path, *rest, **kwargs):
        if str(path) == "/proc/meminfo":
            return io.StringIO(f"MemAvailable: {int(memory['free']) // 1024} kB\n")
        if str(path).startswith("/sys/fs/cgroup"):
            raise OSError("no cgroup")
        return opened(path, *rest, **kwargs)

    monkeypatch.setattr("builtins.open", fake_open)
    return memory


@contextlib.contextmanager
def address_space_limit(room):
    """Within it, this process may map only `room` bytes more than it has now: an allocation beyond that fails
    (torch's "can't allocate memory", a MemoryError) instead of waking the kernel's OOM killer, which may kill any
    process on the machine. For tests whose failure would otherwise allocate more than the machine has."""
    with open("/proc/self/status") as f:
        mapped = int(re.search(r"VmSize:\s+(\d+) kB", f.read()).group(1)) * 1024
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    resource.setrlimit(resource.RLIMIT_AS, (mapped + room, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))


def check_memory(module, device, buffer_bytes, monkeypatch, **kwargs):
    """`choose_device`'s memory check, for a run on `device` (a GPU faked where there is none)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: device.type == "cuda")
    return module.choose_device(
        module.Args(cuda=device.type == "cuda", torch_deterministic=False), buffer_bytes, **kwargs
    )


@pytest.fixture
def gpu_stand_ins(tmp_path, monkeypatch):
    """Stand-ins for nvidia-smi (listing `gpus` GPUs in compute mode `mode`) and nvidia-cuda-mps-control, first on
    the PATH: gpu_stand_ins(gpus=1) returns the file where both record how they were called, one line a call. The
    daemon's stand-in is a process that lives until `quit` comes (its pid in the log directory's stand-in.pid), so a
    test can see that the daemon a sweep started is gone. They check what the sweep calls; they measure nothing.
    `fail`: the daemon's stand-in refuses to start, as where it is not allowed."""

    def make(gpus=1, mode="Default", fail=False):
        bin_dir, record = tmp_path / "stand-ins", tmp_path / "stand-ins.log"
        bin_dir.mkdir(exist_ok=True)
        listing = "".join(f"echo 'GPU {i}: Stand-in GPU (UUID: GPU-stand-in-{i})'; " for i in range(gpus))
        (bin_dir / "nvidia-smi").write_text(
            f'#!/usr/bin/env bash\necho "nvidia-smi $*" >> {record}\n'
            f'case "$1" in -L) {listing};; --query-gpu=compute_mode) for i in $(seq {gpus}); do echo {mode}; done;; '
            "esac\n"
        )
        (bin_dir / "nvidia-cuda-mps-control").write_text(
            "#!/usr/bin/env bash\n"
            'pipe="$CUDA_MPS_PIPE_DIRECTORY" pid="$CUDA_MPS_LOG_DIRECTORY/stand-in.pid"\n'
            'if [ "$1" = -d ]; then\n'
            f'  echo "-d pipe=$pipe log=$CUDA_MPS_LOG_DIRECTORY visible=$CUDA_VISIBLE_DEVICES" >> {record}\n'
            + ('  echo "An MPS daemon may not be started here" >&2; exit 1\n' if fail else "")
            + "  setsid sleep 3600 </dev/null >/dev/null 2>&1 &\n"
            + '  echo $! > "$pid"; touch "$pipe/control"\n'
            f'else\n  read -r command; echo "$command pipe=$pipe" >> {record}\n'
            '  [ "$command" = quit ] && kill "$(cat "$pid")" && rm "$pipe/control"\nfi\n'
        )
        for tool in bin_dir.iterdir():
            tool.chmod(0o755)
        monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
        monkeypatch.delenv("CUDA_MPS_PIPE_DIRECTORY", raising=False)
        record.touch()
        return record

    return make


def ends(pid, within=10.0):
    """True when process `pid` has ended (or only a zombie is left, not yet reaped) within `within` seconds: a
    daemon told to quit ends after the command that told it returns."""
    deadline = time.time() + within
    while time.time() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rpartition(")")[2].split()[0] == "Z":
                    return True
        except OSError:
            return True
        time.sleep(0.1)
    return False


# The two tiers (README, Tests). The first, `python -m pytest tests -m "not slow"`, keeps every script's unit tests, a
# short run of each through its real command line, its bad input and its resume, and each lifecycle case for one
# script, td3_continuous; the second, `-m slow`, is everything below, which `python -m pytest tests` runs too (CI runs
# that on both cores, `-n 2`). Chosen from each test's duration on the 2-core machine (the README's Tests section gives
# both tiers' times).
SECOND_TIER = [
    "tests/test_learning.py",  # the learning tests: 2 to 6 minutes each
    "tests/test_golden.py",  # the golden runs
    "tests/test_gpu.py",  # (skipped without a GPU)
    "tests/test_fast_path.py::test_compile_matches_eager_and_compiles_once",  # inductor's compilation: 20 s to 2 min
    "tests/test_erl.py::test_compile_keeps_compiling_every_learners_steps",
    "tests/test_common.py::test_capture_video_writes_frames",  # video
    "tests/test_common.py::test_progress_on_a_terminal",  # a pseudo-terminal, 30-60 s a script
    "tests/test_common.py::test_track_wandb_offline",  # W&B starts a service of its own
    "tests/test_common.py::test_no_mujoco_deprecation_noise",
    "tests/test_sac.py::test_atari",  # Atari
    "tests/test_sac.py::test_evaluation_of_a_policy_that_never_fires_ends_in_breakout",
    "tests/test_benchmark.py::test_sweep_on_slurm",  # Slurm
    "tests/test_benchmark.py::test_two_runs_per_slurm_task",
    "tests/test_benchmark.py::test_preempting_a_slurm_task_checkpoints_every_run_in_it",
    "tests/test_erl.py::test_shared_critic",  # whole ERL runs of several generations
    "tests/test_erl.py::test_learners_are_injected_only_once_they_have_trained",
    "tests/test_erl.py::test_erls_learner_settings_run_and_log_the_learners_saturation",
    "tests/test_td7.py::test_sigterm_inside_a_burst",
    "tests/test_td7.py::test_offline_mode_trains_on_a_saved_buffer",
    "tests/test_erl.py::test_signal_during_a_generations_updates",
]
# Per-script cases whose mechanism is the same text in every script: the first tier runs td3_continuous's alone.
ONE_SCRIPT_IN_THE_FIRST_TIER = [
    "tests/test_lifecycle.py",
    "tests/test_bad_input.py::test_an_update_that_cannot_allocate",
]


def pytest_collection_modifyitems(config, items):
    # The learning tests first: with -n 2 (both cores, as CI runs the suite) the longest are handed out before the rest,
    # so that no worker starts a 5-minute test while the other has nothing left (a stable sort: the rest keep order).
    items.sort(key=lambda item: not item.nodeid.startswith("tests/test_learning.py"))
    for item in items:
        script = getattr(item, "callspec", None) and item.callspec.params.get("script")
        if item.nodeid.startswith(tuple(SECOND_TIER)) or (
            item.nodeid.startswith(tuple(ONE_SCRIPT_IN_THE_FIRST_TIER)) and script not in (None, "td3_continuous")
        ):
            item.add_marker(pytest.mark.slow)
