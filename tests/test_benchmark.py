"""The benchmark tools: benchmark/sweep.py in local mode (runs in parallel, keeps going past a failing run and
reports it, skips finished runs, resumes unfinished ones) and as a Slurm job array on a real single-node cluster,
and benchmark/report.py on synthetic evaluation files."""

import csv
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pytest

from benchmark import report
from tests.conftest import REPO, cli_env, ends, flags_with, run_cli

SWEEP = "sweeps/td3_continuous"  # the default directory of a td3_continuous.py sweep, below the sweep's cwd
FLAGS = [
    "--",
    "--total-timesteps",
    "300",
    "--learning-starts",
    "100",
    "--batch-size",
    "32",
    "--eval-episodes",
    "1",
    "--no-cuda",
    "--checkpoint-freq",
    "0",
]


def sweep_cli(cwd, *args, env=None, start=False, timeout=300):
    """`python benchmark/sweep.py td3_continuous.py ARGS` in `cwd`: run to its end (or started, with start=True)."""
    cmd = [sys.executable, str(REPO / "benchmark" / "sweep.py"), "td3_continuous.py", *args]
    pipes = dict(cwd=cwd, env={**cli_env(), **(env or {})}, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    return subprocess.Popen(cmd, **pipes) if start else subprocess.run(cmd, timeout=timeout, **pipes)


def sweep(cwd, envs, *options, flags=FLAGS, timeout=300):
    """A sweep of `envs` x seeds 1 and 2 (with `options`, default 2 workers) and `flags` for every run."""
    return sweep_cli(
        cwd, "--envs", *envs, "--seeds", "1", "2", *(options or ["--workers", "2"]), *flags, timeout=timeout
    )


def test_sweep_reports_failures_and_skips_finished_runs(tmp_path):
    first = sweep(tmp_path, ["tests.toy_envs:Counter-v0", "NoSuchEnv-v0"])
    assert first.returncode == 1
    assert all(f"done   tests.toy_envs:Counter-v0 seed {s}" in first.stdout for s in (1, 2))
    assert "2 of 4 runs failed: NoSuchEnv-v0 seed 1, NoSuchEnv-v0 seed 2" in first.stderr
    assert "cannot make --env-id" in (tmp_path / SWEEP / "logs/td3_continuous__NoSuchEnv-v0__1.log").read_text()
    assert len(list((tmp_path / SWEEP / "runs").glob("*/evaluations.csv"))) == 2
    again = sweep(tmp_path, ["tests.toy_envs:Counter-v0"])
    assert again.returncode == 0
    assert "0 runs to do (0 resumed), 2 already finished" in again.stdout


def test_sweep_resumes_an_unfinished_run(tmp_path):
    """A run of 300 steps killed after its checkpoint at 150 (made here as a run of 150 steps whose args.json then
    says 300, which is what such a run leaves) is resumed from its checkpoint.pt, not started again."""
    flags = flags_with(FLAGS, total_timesteps=150, checkpoint_freq=150)
    assert sweep(tmp_path, ["tests.toy_envs:Counter-v0"], "--workers", "2", flags=flags).returncode == 0
    run = next((tmp_path / SWEEP / "runs").glob("*__1__*"))
    args = json.loads((run / "args.json").read_text())
    (run / "args.json").write_text(json.dumps({**args, "total_timesteps": 300}))
    again = sweep(tmp_path, ["tests.toy_envs:Counter-v0"], "--workers", "2", flags=FLAGS)
    assert again.returncode == 0, again.stdout + again.stderr
    assert "1 runs to do (1 resumed), 1 already finished" in again.stdout, again.stdout
    log = (tmp_path / SWEEP / "logs/td3_continuous__tests.toy_envs:Counter-v0__1.log").read_text()
    assert f"resumed {run} at global_step 150" in log
    assert (run / "evaluations.csv").read_text().splitlines()[-1].startswith("300,")


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_stopping_a_sweep(signum, tmp_path):
    """Ctrl-C or SIGTERM to a sweep reaches every running run, which writes its checkpoint; nothing new starts, no
    run is left behind, the sweep ends with one line and 128 + signal, and started again it resumes both runs. A
    second sweep over the same directory meanwhile is refused."""
    name = f"stopped{tmp_path.name}"  # in every run's command line: how to find a run left behind
    flags = flags_with(FLAGS, total_timesteps=10**6, checkpoint_freq=0, eval_freq=0, exp_name=name)
    options = ["--envs", "tests.toy_envs:Counter-v0", "--workers", "2", "--dir", "s", *flags]
    proc = sweep_cli(tmp_path, "--seeds", "1", "2", "3", *options, start=True)
    logs = [tmp_path / f"s/logs/{name}__tests.toy_envs:Counter-v0__{seed}.log" for seed in (1, 2)]
    deadline = time.time() + 120
    # Both runs started: each has said so (its first line, once it handles signals itself).
    while not all(log.exists() and " steps on " in log.read_text() for log in logs) and time.time() < deadline:
        time.sleep(0.2)
    second = sweep_cli(tmp_path, *options, timeout=60)
    assert second.returncode == 1
    assert second.stderr.startswith(f"error: another sweep works in s: process {proc.pid}"), second.stderr
    proc.send_signal(signum)
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signum, stdout + stderr
    assert "Traceback" not in stdout + stderr
    assert stderr.strip().splitlines() == [
        f"sweep stopped by {signal.Signals(signum).name}: 0 done, 0 failed, 1 not started; start it again to go on"
    ]
    runs = sorted((tmp_path / "s" / "runs").iterdir())
    assert len(runs) == 2
    assert all((run / "checkpoint.pt").exists() for run in runs)
    assert subprocess.run(["pgrep", "-f", name], capture_output=True).returncode == 1, "a run outlived its sweep"
    again = sweep_cli(tmp_path, "--seeds", "1", "2", "3", "--dry-run", *options, timeout=60)
    assert "3 runs to do (2 resumed), 0 already finished" in again.stdout, again.stdout
    listed = again.stdout.splitlines()[1:]  # each run it would start or resume, as it would start it
    for line, run, seed in zip(listed, [*runs, None], (1, 2, 3), strict=True):
        assert line.startswith(f"{'resume' if run else 'start'} tests.toy_envs:Counter-v0 seed {seed} in s: "), line
        assert f"--seed {seed} --torch-threads 1 --total-timesteps 1000000" in line, line
        assert f"--exp-name {name}" in line and line.endswith(f" --resume {run / 'checkpoint.pt'}" if run else ""), line


def test_sweep_matches_names_literally_and_refuses_what_it_cannot_use(tmp_path):
    """An exp name holding glob characters finds its own runs and no other experiment's; a --dir that is a file, and
    --slurm without sbatch, are one error line each."""
    star = flags_with(FLAGS, exp_name="a*")
    assert (
        sweep(tmp_path, ["tests.toy_envs:Counter-v0"], "--dir", "s", flags=flags_with(FLAGS, exp_name="ab")).returncode
        == 0
    )
    result = sweep(tmp_path, ["tests.toy_envs:Counter-v0"], "--dir", "s", "--dry-run", flags=star)
    assert "2 runs to do (0 resumed), 0 already finished" in result.stdout, result.stdout
    brackets = flags_with(FLAGS, exp_name="abl[1]")
    assert sweep(tmp_path, ["tests.toy_envs:Counter-v0"], "--dir", "s", flags=brackets).returncode == 0
    result = sweep(tmp_path, ["tests.toy_envs:Counter-v0"], "--dir", "s", "--dry-run", flags=brackets)
    assert "0 runs to do (0 resumed), 2 already finished" in result.stdout, result.stdout
    (tmp_path / "file").write_text("")
    for options, expected in [
        (["--dir", "file"], "error: cannot use file as a sweep directory"),
        (["--slurm", "--dir", "t"], "error: --slurm needs Slurm's sbatch"),
    ]:
        result = sweep_cli(tmp_path, *options, env={"PATH": os.path.dirname(sys.executable)}, timeout=60)
        assert result.returncode == 1
        assert result.stderr.strip() == result.stderr.strip().splitlines()[0], result.stderr
        assert result.stderr.startswith(expected), result.stderr


def slurm_available():
    return shutil.which("sbatch") is not None and subprocess.run(["sinfo", "-h"], capture_output=True).returncode == 0


def needs_slurm():
    if not slurm_available():
        if os.environ.get("CI"):
            pytest.fail("no Slurm cluster answers; .ci/run starts one with .ci/slurm-up")
        pytest.skip("no Slurm cluster here (bash .ci/slurm-up starts a single-node one)")


SLURM = ["--slurm", "--time", "10", "--mem", "1G", "--wait"]  # a job array of tiny runs, waited for


def finished_runs(sweep_dir):
    """The last evaluation's step of each seed's run in a td3_continuous sweep of Counter-v0."""
    runs = sorted((sweep_dir / "runs").glob("tests.toy_envs-Counter-v0__td3_continuous__*"))
    return [int(list(csv.DictReader(open(run / "evaluations.csv")))[-1]["global_step"]) for run in runs]


def test_sweep_on_slurm(tmp_path):
    """The same runs as a job array on the real single-node cluster that .ci/run starts: sbatch --wait returns
    when the array is done, and every run's results are there."""
    needs_slurm()
    result = sweep(tmp_path, ["tests.toy_envs:Counter-v0"], *SLURM, "--cpus-per-task", "1", timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "all 2 runs finished" in result.stdout
    assert "#SBATCH --array=0-1" in (tmp_path / SWEEP / "logs/td3_continuous.sbatch").read_text()
    assert finished_runs(tmp_path / SWEEP) == [300, 300]
    assert len(list((tmp_path / SWEEP / "logs").glob("slurm-*_*.out"))) == 2
    again = sweep(tmp_path, ["tests.toy_envs:Counter-v0"], "--slurm")
    assert again.returncode == 0
    assert "0 runs to submit, 2 already finished" in again.stdout


def test_two_runs_per_slurm_task(tmp_path):
    """--runs-per-gpu 2 on the cluster (--gpus 0: its node has no GPU): one task of two cores holds both runs, which
    run at once, each with its own log and directory as in a local sweep."""
    needs_slurm()
    result = sweep(tmp_path, ["tests.toy_envs:Counter-v0"], *SLURM, "--runs-per-gpu", "2", "--gpus", "0", timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "(1 tasks, 2 runs)" in result.stdout and "all 2 runs finished" in result.stdout, result.stdout
    assert finished_runs(tmp_path / SWEEP) == [300, 300]
    (out,) = (tmp_path / SWEEP / "logs").glob("slurm-*_*.out")
    assert "2 runs to do (0 resumed), 0 already finished; 2 at a time" in out.read_text()
    assert all((tmp_path / SWEEP / f"logs/td3_continuous__tests.toy_envs:Counter-v0__{s}.log").exists() for s in (1, 2))


def test_preempting_a_slurm_task_checkpoints_every_run_in_it(tmp_path):
    """SIGTERM to a task of two runs (as its --signal=B:TERM sends it to the task's sweep before the time limit)
    reaches both runs, which write their checkpoints; the task ends and leaves no run behind."""
    needs_slurm()
    name = f"preempt{os.getpid()}"
    flags = flags_with(FLAGS, total_timesteps=10**6, checkpoint_freq=0, eval_freq=0, exp_name=name)
    options = [*SLURM[:-1], "--runs-per-gpu", "2", "--gpus", "0"]  # SLURM without --wait: the test stops the task
    result = sweep(tmp_path, ["tests.toy_envs:Counter-v0"], *options, flags=flags)
    job = result.stdout.split("submitted job array ")[1].split()[0]
    logs = [tmp_path / f"sweeps/{name}/logs/{name}__tests.toy_envs:Counter-v0__{seed}.log" for seed in (1, 2)]
    try:
        deadline = time.time() + 300
        while not all(log.exists() and " steps on " in log.read_text() for log in logs) and time.time() < deadline:
            time.sleep(0.5)
        subprocess.run(["scancel", "--batch", "--signal=TERM", job], check=True)
        while subprocess.run(["squeue", "-h", "-j", job], capture_output=True, text=True).stdout.strip():
            assert time.time() < deadline + 120, f"job {job} did not end after SIGTERM"
            time.sleep(0.5)
    finally:
        subprocess.run(["scancel", job])
    assert all("SIGTERM at global_step" in log.read_text() for log in logs), [log.read_text() for log in logs]
    assert len(list((tmp_path / f"sweeps/{name}/runs").glob("*/checkpoint.pt"))) == 2
    (out,) = (tmp_path / f"sweeps/{name}/logs").glob("slurm-*_0.out")
    assert "sweep stopped by SIGTERM: 0 done, 0 failed, 0 not started" in out.read_text(), out.read_text()
    assert subprocess.run(["pgrep", "-f", name], capture_output=True).returncode == 1, "a run outlived its task"


def test_sweep_status_line_fits_the_terminal(tmp_path, monkeypatch, capsys):
    """On a terminal the status line shares its width between the running runs' last progress lines (less the bar's
    blocks), and never wraps."""
    from benchmark import sweep as sweep_tool

    progress = " 25%|██▌       | 75000/300000 steps, ETA 5:01:28, 12 steps/s, 12 updates/s, last eval 514.8 +- 2.8"
    logs = {("Hopper-v4", seed): (None, tmp_path / f"{seed}.log") for seed in (1, 2)}
    for _, log in logs.values():
        log.write_text("run ...\n" + progress + "\n")
    for columns in (80, 240):
        monkeypatch.setattr(sweep_tool.shutil, "get_terminal_size", lambda: os.terminal_size((columns, 24)))
        status = sweep_tool.Status(2)
        status.tty = True
        status.update(0, 0, logs)
        line = capsys.readouterr().out.split("\033[K")[-1]
        assert len(line) <= columns - 1
        assert line.count("Hopper-v4 ") == 2 and "█" not in line, line
    assert line.endswith(
        "Hopper-v4 2: 75000/300000 steps, ETA 5:01:28, 12 steps/s, 12 updates/s, last eval 514.8 +- 2.8"
    )


needs_two_cores = pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="two runs pinned to a core each")


def run_environment(pid):
    """A running process's cores and CUDA environment, read from /proc: what it was really given."""
    with open(f"/proc/{pid}/environ") as f:
        env = dict(item.split("=", 1) for item in f.read().split("\0") if "=" in item)
    return sorted(os.sched_getaffinity(pid)), {k: v for k, v in env.items() if k.startswith("CUDA_")}


def mps_dirs(record):
    """The pipe and log directories of the one MPS daemon a sweep started, as the daemon's stand-in was given them."""
    (start,) = [line.split() for line in record.read_text().splitlines() if line.startswith("-d ")]
    return Path(start[1].removeprefix("pipe=")), Path(start[2].removeprefix("log="))


@pytest.fixture
def short_tmp():
    """A fresh directory in /tmp, removed after the test: pytest's tmp_path can be too deep for a unix socket's path
    (under xdist it is)."""
    path = Path(tempfile.mkdtemp(prefix="s"))
    yield path
    shutil.rmtree(path)


@needs_two_cores
@pytest.mark.parametrize("long_dir", [False, True])
def test_sweep_fills_a_gpu_and_runs_its_mps_daemon(long_dir, tmp_path, short_tmp, gpu_stand_ins):
    """--runs-per-gpu 2 on the one GPU nvidia-smi's stand-in lists: two runs at a time, on cores 0 and 1, the third on
    the core that one of them left; an MPS control daemon started for that GPU (logs under the sweep's directory, the
    pipe there too unless its socket's path would be too long, then in /tmp and removed with the daemon; the daemon
    shown the GPU by its UUID) and told to quit at the end; each run's GPU said as it starts and ends and in the
    summary."""
    record = gpu_stand_ins(gpus=1)
    sweep_dir = tmp_path / ("s" * 90) if long_dir else short_tmp
    result = sweep_cli(
        tmp_path, "--envs", "tests.toy_envs:Counter-v0", "--seeds", "1", "2", "3", "--runs-per-gpu", "2",
        "--dir", str(sweep_dir), *FLAGS,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
    assert "3 runs to do (0 resumed), 0 already finished; 2 at a time" in out, out
    assert "2 runs on each of GPU 0, each run pinned to 1 core of its own" in out, out
    assert "start  tests.toy_envs:Counter-v0 seed 1 on GPU 0, core 0" in out, out
    assert "start  tests.toy_envs:Counter-v0 seed 2 on GPU 0, core 1" in out, out
    first_done = next(line for line in out.splitlines() if line.startswith("done   "))
    assert f"start  tests.toy_envs:Counter-v0 seed 3 on GPU 0, core {first_done[-2]}" in out, out
    assert out.strip().splitlines()[-1] == (
        "GPU 0: tests.toy_envs:Counter-v0 seed 1, tests.toy_envs:Counter-v0 seed 2, tests.toy_envs:Counter-v0 seed 3"
    )
    assert len(list((sweep_dir / "runs").glob("*/evaluations.csv"))) == 3
    (root,) = (sweep_dir / "mps").iterdir()
    pipe, logs = mps_dirs(record)
    assert logs == root.resolve() / "gpu0"
    calls = [line for line in record.read_text().splitlines() if not line.startswith("nvidia-smi")]
    assert calls == [f"-d pipe={pipe} log={logs} visible=GPU-stand-in-0", f"quit pipe={pipe}"]
    if not long_dir:
        assert pipe == logs / "pipe"
    else:  # a unix socket's path has at most 107 bytes: the pipe in /tmp, gone with its daemon
        assert pipe.parent == Path(tempfile.gettempdir()) and pipe.name.startswith("mps-gpu0-")
        assert not pipe.exists()
    assert ends(int((logs / "stand-in.pid").read_text()))


@needs_two_cores
@pytest.mark.parametrize("mps", [True, False])
def test_ctrl_c_to_a_gpu_sweep_leaves_no_run_and_no_daemon(mps, tmp_path, gpu_stand_ins):
    """While they run, each of the two runs is pinned to its own core and sees its GPU: through the MPS daemon's
    pipe (CUDA_VISIBLE_DEVICES unset, as NVIDIA's MPS guide asks of a client), or with --no-mps as
    CUDA_VISIBLE_DEVICES (and a GPU in exclusive-process mode is said to hold one run). Ctrl-C then checkpoints
    both, and leaves no run and no daemon behind."""
    record = gpu_stand_ins(gpus=1, mode="Default" if mps else "Exclusive_Process")
    name = f"gpu{mps}{os.getpid()}"  # in each run's command line: how to find it
    flags = flags_with(FLAGS, total_timesteps=10**6, checkpoint_freq=0, eval_freq=0, exp_name=name)
    options = ["--runs-per-gpu", "2", *([] if mps else ["--no-mps"]), "--dir", "s"]
    proc = sweep_cli(tmp_path, "--envs", "tests.toy_envs:Counter-v0", "--seeds", "1", "2", *options, *flags, start=True)
    try:
        logs = [tmp_path / f"s/logs/{name}__tests.toy_envs:Counter-v0__{seed}.log" for seed in (1, 2)]
        deadline = time.time() + 120
        while not all(log.exists() and " steps on " in log.read_text() for log in logs) and time.time() < deadline:
            time.sleep(0.2)
        pids = subprocess.run(["pgrep", "-f", name], capture_output=True, text=True).stdout.split()
        seen = sorted((run_environment(int(pid)) for pid in pids if int(pid) != proc.pid), key=str)  # the runs
        if mps:
            pipe, logs = mps_dirs(record)
            cuda = {"CUDA_MPS_PIPE_DIRECTORY": str(pipe), "CUDA_MPS_LOG_DIRECTORY": str(logs)}
        else:
            cuda = {"CUDA_VISIBLE_DEVICES": "GPU-stand-in-0"}
        assert seen == [([0], cuda), ([1], cuda)]
    finally:  # the runs stop, as a user's Ctrl-C stops them, even where a check failed
        proc.send_signal(signal.SIGINT)
        stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGINT, stdout + stderr
    assert all(f"stopped tests.toy_envs:Counter-v0 seed {s} (GPU 0, core {s - 1})" in stdout for s in (1, 2)), stdout
    assert len(list((tmp_path / "s/runs").glob("*/checkpoint.pt"))) == 2
    assert subprocess.run(["pgrep", "-f", name], capture_output=True).returncode == 1, "a run outlived its sweep"
    calls = [line.split()[0] for line in record.read_text().splitlines() if not line.startswith("nvidia-smi")]
    assert calls == (["-d", "quit"] if mps else [])
    exclusive = "a GPU is in compute mode Exclusive_Process: it takes one process, so one run unless MPS serves it"
    assert (exclusive in stdout) == (not mps), stdout
    if mps:
        assert ends(int((logs / "stand-in.pid").read_text())), "the MPS daemon outlived its sweep"


def test_mps_is_started_only_where_it_can_be_and_others_are_left_alone(tmp_path, gpu_stand_ins, monkeypatch):
    """One line each, and no daemon started: without the binary, where a daemon this sweep did not start already
    answers (never stopped either), with a GPU in compute mode Prohibited; where starting is refused, the refusal's
    first line. Exclusive-process mode is the mode NVIDIA's guide sets up MPS in: it starts."""
    from benchmark import sweep as sweep_tool

    gpus = [sweep_tool.Gpu("0", "GPU-stand-in-0")]

    def start(**stand_in):
        record, said = gpu_stand_ins(**stand_in), []
        started = sweep_tool.start_mps(gpus, tmp_path / "sweep", said.append)
        calls = [line for line in record.read_text().splitlines() if not line.startswith("nvidia-smi")]
        sweep_tool.stop_mps(started, said.append)
        record.write_text("")
        return said, calls

    said, calls = start(mode="Exclusive_Process")
    assert said[0].startswith("MPS: a control daemon for each of GPU 0, logs in ") and calls[0].startswith("-d ")
    said, calls = start(fail=True)
    assert said == ["MPS: nvidia-cuda-mps-control -d failed for GPU 0 (exit 1: An MPS daemon may not be started "
                    "here): its runs time-slice"]  # fmt: skip
    said, calls = start(mode="Prohibited")
    assert said == ["MPS: a GPU is in compute mode Prohibited (nvidia-smi -c): no process may use it, MPS neither"]
    assert calls == []
    theirs = tmp_path / "their-mps"
    theirs.mkdir()
    (theirs / "control").touch()
    monkeypatch.setenv("CUDA_MPS_PIPE_DIRECTORY", str(theirs))
    assert sweep_tool.start_mps(gpus, tmp_path / "sweep", said.append) == {}
    assert said[-1].startswith(f"MPS: a control daemon that this sweep did not start answers in {theirs}")
    monkeypatch.setenv("PATH", os.path.dirname(sys.executable))
    assert sweep_tool.start_mps(gpus, tmp_path / "sweep", said.append) == {}
    assert said[-1] == "MPS: no nvidia-cuda-mps-control on the PATH: the runs on a GPU share it by time-slicing"


def test_gpus_seen_and_runs_placed(gpu_stand_ins, monkeypatch):
    """The GPUs: CUDA_VISIBLE_DEVICES's entries where it is set (empty or -1: none), else nvidia-smi -L's, by index
    and UUID. The places: the GPUs in turn, each run with --threads cores of its own; None where they do not fit."""
    from benchmark.sweep import Gpu, places, visible_gpus

    gpu_stand_ins(gpus=2)
    assert visible_gpus() == [Gpu("0", "GPU-stand-in-0"), Gpu("1", "GPU-stand-in-1")]
    for value, names in [("2,3", ["2", "3"]), ("", []), ("-1", [])]:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", value)
        assert [gpu.name for gpu in visible_gpus()] == names
    a, b = Gpu("0", "a"), Gpu("1", "b")
    placed = places([a, b], 2, 2, list(range(8)))
    assert [(p.gpu, p.cores, str(p)) for p in placed] == [
        (a, [0, 1], "GPU 0, cores 0,1"),
        (b, [2, 3], "GPU 1, cores 2,3"),
        (a, [4, 5], "GPU 0, cores 4,5"),
        (b, [6, 7], "GPU 1, cores 6,7"),
    ]
    assert places([a, b], 2, 2, list(range(7))) is None


def test_gpu_sweep_without_a_gpu_or_with_too_few_cores(tmp_path, gpu_stand_ins):
    """Without a GPU, --runs-per-gpu is said in one line and the sweep goes on as without it; more runs than cores,
    and a GPU id it does not see, are one error line each."""
    gpu_stand_ins(gpus=1)
    cores = len(os.sched_getaffinity(0))
    none = sweep_cli(tmp_path, "--runs-per-gpu", "2", "--dry-run", env={"CUDA_VISIBLE_DEVICES": ""}, timeout=60)
    assert none.stdout.startswith(
        "--runs-per-gpu 2: no GPU seen (CUDA_VISIBLE_DEVICES names none), so the runs go on the CPU as without it\n"
        f"15 runs to do (0 resumed), 0 already finished; {cores} at a time"
    ), none.stdout
    for options, expected in [
        (["--runs-per-gpu", str(cores + 1)], f"error: --runs-per-gpu {cores + 1} on 1 GPU at --threads 1 needs "),
        (["--runs-per-gpu", "1", "--gpu-ids", "3"], "error: --gpu-ids 3: not among the GPUs seen (0)"),
    ]:
        result = sweep_cli(tmp_path, *options, "--dry-run", timeout=60)
        assert result.returncode == 1 and result.stderr.startswith(expected), result.stderr


def test_slurm_tasks_of_runs_per_gpu(tmp_path):
    """With --runs-per-gpu 2 a task holds two runs on one GPU: it asks for one GPU and two cores, and each run gets
    one thread; with --gpus 0 it asks for none and its runs see none."""
    job = sweep_cli(tmp_path, "--envs", "Hopper-v4", "--seeds", "1", "2", "3", "--slurm", "--runs-per-gpu", "2",
                    "--dry-run", timeout=60).stdout  # fmt: skip
    assert "#SBATCH --array=0-1\n" in job and "#SBATCH --cpus-per-task=2\n" in job and "#SBATCH --gres=gpu:1\n" in job
    assert "TASKS=('Hopper-v4@1 Hopper-v4@2' Hopper-v4@3)\n" in job
    assert "#SBATCH --mem=16G\n" in job  # 8G for each of its runs
    assert "#SBATCH --signal=B:TERM@300\n" in job  # to the sweep, which passes it on and then stops MPS
    assert "--task-runs ${TASKS[$SLURM_ARRAY_TASK_ID]} --runs-per-gpu 2 --threads 1 --slurm-task" in job, job
    assert "CUDA_VISIBLE_DEVICES" not in job
    cpu = sweep(tmp_path, ["Hopper-v4"], "--slurm", "--runs-per-gpu", "2", "--gpus", "0", "--no-mps", "--dry-run")
    assert "--gres" not in cpu.stdout and "\nexport CUDA_VISIBLE_DEVICES=\n" in cpu.stdout, cpu.stdout
    assert "--runs-per-gpu 2 --threads 1 --no-mps --slurm-task" in cpu.stdout


def test_steady_speed_is_timed_by_the_events_wall_time():
    """TD7's pattern: the first update at the first episode end after --learning-starts (step 1130, not 1000), and
    bursts of updates logging several points at one step, each step timed by its last point. The middle of 1130-2500
    is nearest step 2000 (its last point at 16 s): 500 steps in 2 s."""
    from benchmark.speed import steady_sps

    points = [(1130, 10.0), (1500, 11.0), (1500, 12.0), (1500, 13.0), (2000, 15.0), (2000, 16.0), (2500, 18.0)]
    assert steady_sps(points) == 250.0
    assert math.isnan(steady_sps([(1130, 10.0), (1130, 11.0)]))


def test_together_figures():
    """Two repeats of two copies: totals 220 and 200, median 210, 3.5 times one copy's 60; each copy's sorted; the
    slowest over the fastest 90 / 120."""
    from benchmark.speed import together

    copies = [[{"steady_sps": 100.0}, {"steady_sps": 120.0}], [{"steady_sps": 90.0}, {"steady_sps": 110.0}]]
    assert together(copies, 60.0) == (210.0, 3.5, [90.0, 100.0, 110.0, 120.0], 0.75)
    assert together(copies[:1])[1] is None


# A program stepping gymnasium envs: 2 ms a step (a vector step: 2 envs), writing its count of finished steps.
STEPPER = """
import sys, time, gymnasium as gym
vector = sys.argv[1] == "vector"
env = gym.make_vec("CartPole-v1", 2, "sync") if vector else gym.make("CartPole-v1")
env.reset(seed=0)
for done in range(1, 5000):
    _, _, terminated, truncated, _ = env.step(env.action_space.sample())
    if not vector and (terminated or truncated):
        env.reset()
    time.sleep(0.002)
    open("count", "w").write(str(done))
"""


@pytest.mark.parametrize("kind", ["env", "vector"])
def test_anchor_timing_counts_each_env_step_once_and_ends_the_program(kind, tmp_path):
    """benchmark/anchors.py's hook: the program ends in its 1200th env step (1000 random steps, 200 updates), the
    600th of a 2-env vector env's (its envs' own steps, reset steps of its next-step autoreset among them, not counted
    again); its figures are what 2 ms a step gives (a step counted twice would double them)."""
    from benchmark.anchors import measure, timing_folder

    timing_folder(tmp_path)
    figures = measure([sys.executable, "-c", STEPPER, kind], [], {}, 200, tmp_path)
    assert isinstance(figures, dict), figures
    assert (tmp_path / "count").read_text() == ("599" if kind == "vector" else "1199")
    per_step = 2 if kind == "vector" else 1
    for key in ("steady_sps", "sps"):
        assert 100 * per_step < figures[key] < 500 * per_step, figures
    assert 0 < figures["startup_s"] < 60 and figures["peak_rss_mib"] > 10 and figures["peak_cuda_mib"] is None


BURSTS = """
import time, gymnasium as gym
env = gym.make("Pendulum-v1", max_episode_steps=70)
env.reset(seed=0)
while True:
    _, _, terminated, truncated, _ = env.step(env.action_space.sample())
    if terminated or truncated:
        time.sleep(0.28)  # 70 updates of 4 ms each, held back to the episode's end as TD7 holds them
        env.reset()
"""


def test_anchor_timing_of_updates_held_to_an_episodes_end(tmp_path):
    """Updates run in a burst at each 70-step episode's end (TD7's way): the figures are 70 steps per 0.28 s, 250
    steps/s, where the marks' window (steps 1100 to 1200) would take in two bursts for 100 steps, 179 steps/s."""
    from benchmark.anchors import measure, timing_folder

    timing_folder(tmp_path)
    figures = measure([sys.executable, "-c", BURSTS], [], {}, 200, tmp_path)
    assert isinstance(figures, dict), figures
    for key in ("steady_sps", "sps"):
        assert 220 < figures[key] <= 250, figures


# Per env step 4 ATen ops (add, the view t, sum, and item's _local_scalar_dense), and an Adam step every 2nd step
# over 4 parameters, left to choose its implementation; 50-step episodes.
OPS = """
import torch, gymnasium as gym
params = [torch.zeros(8, requires_grad=True) for _ in range(4)]
for param in params:
    param.grad = torch.ones(8)
adam, x = torch.optim.Adam(params), torch.zeros(2, 2)
env = gym.make("Pendulum-v1", max_episode_steps=50)
env.reset(seed=0)
for step in range(5000):
    if any(env.step(env.action_space.sample())[2:4]):
        env.reset()
    y = x + 1
    y.t()
    y.sum().item()
    if step % 2 == 0:
        adam.step()
"""


def test_anchor_ops_counted_by_kind(tmp_path):
    """--ops, between episodes' ends: the program's 4 ops a step, 1 of them a view and 1 an item, and half an
    optimizer step, whose ops are counted apart and are those of the foreach implementation that a GPU takes (17 in
    torch 2.13, where the for-loop that the CPU takes makes 36)."""
    from benchmark.anchors import measure, timing_folder

    timing_folder(tmp_path)
    figures = measure([sys.executable, "-c", OPS], [], {}, 200, tmp_path, count_ops=True)
    assert isinstance(figures, dict), figures
    ops = figures["ops"]
    assert (ops["ops"] - ops["in optimizer steps"], ops["views"], ops["item"]) == (4, 1, 1), ops
    assert ops["optimizer steps"] == 0.5 and 0 < ops["in optimizer steps"] / 0.5 < 20, ops


def test_leanrl_without_wandb_gets_a_stand_in(tmp_path, monkeypatch):
    """Where tensordict and torchrl are installed and wandb is not, LeanRL's command gets a wandb that does nothing:
    a program that imports it, calls init and log as LeanRL's scripts do and steps an env, is timed."""
    import benchmark.anchors as anchors

    found = {"tensordict": True, "torchrl": True, "wandb": None}
    monkeypatch.setattr(anchors.importlib.util, "find_spec", lambda name, *args: found.get(name, True))
    script = tmp_path / "anchors" / "LeanRL" / "leanrl" / "td3_continuous_action_torchcompile.py"
    script.parent.mkdir(parents=True)
    uses = "import wandb\nwandb.init(project='x', config={})\nwandb.log({'a': 1}, step=1)\n"
    script.write_text(uses + "open('wandb_file', 'w').write(wandb.__file__)\n" + STEPPER)
    adapter = anchors.timing_folder(tmp_path)
    command, paths, env = anchors.anchor_command("leanrl td3", tmp_path / "anchors", "cuda", 200, adapter)
    assert adapter / "no_wandb" in paths and env == {"WANDB_MODE": "disabled"}
    command = [sys.executable, "-c", script.read_text(), "env"]  # (LeanRL's flags dropped: the stand-in takes none)
    assert isinstance(anchors.measure(command, paths, env, 200, tmp_path), dict)
    assert (tmp_path / "wandb_file").read_text() == str(adapter / "no_wandb" / "wandb.py")


@pytest.mark.skipif(shutil.which("nvidia-smi") is not None, reason="a GPU machine runs the phases for real")
def test_gpu_check_without_a_gpu_says_so_and_leaves_no_folder(tmp_path):
    """gpu_check.sh's GPU phases refuse a machine without CUDA in one line, and an unknown phase gets the usage line;
    neither leaves an empty results folder behind."""
    out = tmp_path / "out"
    for phase, rc, line in [("tests", 1, "error: no CUDA GPU"), ("nosuch", 2, "usage: bash benchmark/gpu_check.sh")]:
        env = {**os.environ, "OUT": str(out), "PYTHON": sys.executable, "CUDA_VISIBLE_DEVICES": ""}
        done = subprocess.run(
            ["bash", "benchmark/gpu_check.sh", phase], cwd=REPO, env=env, capture_output=True, text=True
        )
        assert done.returncode == rc and line in done.stderr, (phase, done.returncode, done.stderr)
        assert not out.exists(), phase


@needs_two_cores
def test_speed_copies_are_placed_as_a_sweep_places_them(tmp_path, gpu_stand_ins):
    """On a GPU (the stand-in's one) the copies go as sweep.py --runs-per-gpu places them: a core each, through the
    GPU's MPS daemon when there is one, else shown the GPU by CUDA_VISIBLE_DEVICES. Each copy here reports what it
    was given; none measures anything."""
    from benchmark.speed import start_copies

    gpu_stand_ins(gpus=1)
    cuda_env = "{k: v for k, v in os.environ.items() if k.startswith('CUDA_')}"
    report = f"import json, os; print(json.dumps([sorted(os.sched_getaffinity(0)), {cuda_env}]))"
    mps = {"GPU-stand-in-0": (tmp_path / "pipe", tmp_path)}
    for daemon, cuda in [
        (mps, {"CUDA_MPS_PIPE_DIRECTORY": str(tmp_path / "pipe"), "CUDA_MPS_LOG_DIRECTORY": str(tmp_path)}),
        ({}, {"CUDA_VISIBLE_DEVICES": "GPU-stand-in-0"}),
    ]:
        copies = start_copies([sys.executable, "-c", report], 2, "cuda", 1, daemon)
        assert [json.loads(copy.communicate()[0]) for copy in copies] == [[[0], cuda], [[1], cuda]]


def test_speed_together_on_the_cpu(tmp_path):
    """--together 1 2 on the CPU (a check of the plumbing, at a size that measures nothing worth keeping): a row per
    count with the copies' total, its multiple of one copy's and each copy's, each copy's figure printed; no MPS row
    on a CPU."""
    out = tmp_path / "speed.md"
    options = ["--scripts", "td3_continuous.py", "--devices", "cpu", "--updates", "200", "--repeats", "1"]
    cmd = [sys.executable, str(REPO / "benchmark/speed.py"), *options, "--threads", "1", "--together", "1", "2"]
    result = subprocess.run(
        [*cmd, "--mps", "off", "on", "--out", str(out)], capture_output=True, text=True, cwd=tmp_path
    )
    assert result.returncode == 0, result.stderr
    assert "MPS is for a GPU: no td3_continuous.py row on cpu with MPS on" in result.stdout
    rows = [line.split(" | ") for line in out.read_text().splitlines() if line.startswith("| td3_continuous.py")]
    assert [row[3:5] for row in rows] == [["off", "1"], ["off", "2"]]
    each = [
        line.rpartition(": each ")[2].split(" steps/s")[0] for line in result.stdout.splitlines() if ": each " in line
    ]
    one, two = [float(x) for x in each[0].split(", ")], [float(x) for x in each[1].split(", ")]
    assert len(one) == 1 and len(two) == 2
    assert abs(float(rows[1][5]) - sum(two)) <= 2  # the total: the two copies' steady steps/s (each rounded)
    assert abs(float(rows[1][6]) - sum(two) / one[0]) < 0.05 * sum(two) / one[0]


def write_run(runs, algorithm, env_id, seed, rows):
    run = runs / f"{env_id}__{algorithm}__{seed}__0"
    run.mkdir(parents=True)
    (run / "args.json").write_text(json.dumps({"exp_name": algorithm, "env_id": env_id, "seed": seed}))
    with open(run / "evaluations.csv", "w", newline="") as f:
        out = csv.writer(f)
        out.writerow(["global_step", "wall_time_s", "mean_return", "std_return", "returns"])
        out.writerows([step, 0, value, 0, value] for step, value in rows)


def test_report_numbers_and_plot(tmp_path):
    """Three seeds with known returns: at 200 steps they score 10, 20 and 60 (the last evaluation at or before
    200), so the mean is 30 and the 95% interval 30 +- 4.303 * std(ddof=1) / sqrt(3); a fourth seed that stopped at
    100 steps, or one with no evaluation before 200, is not counted at 200. The IQM of 1..8 is the mean of 3..6."""
    runs = tmp_path / "runs"
    write_run(runs, "td3_continuous", "Hopper-v4", 1, [(100, 0), (200, 10), (300, 99)])
    write_run(runs, "td3_continuous", "Hopper-v4", 2, [(100, 5), (150, 20), (300, 99)])
    write_run(runs, "td3_continuous", "Hopper-v4", 3, [(100, 1), (200, 60), (300, 99)])
    write_run(runs, "td3_continuous", "Hopper-v4", 4, [(100, 7)])
    write_run(runs, "td3_continuous", "Hopper-v4", 5, [(250, 1000)])  # no evaluation at or before 200: not counted
    reference = [
        {
            "algorithm": "td3_continuous",
            "env_id": "Hopper-v4",
            "step": "200",
            "mean": "3135",
            "std": "360",
            "measure": "training return",
            "source": "CleanRL",
        }
    ]
    text = report.table(report.read_runs(runs), [200], reference=reference)
    half = 4.303 * np.std([10, 20, 60], ddof=1) / math.sqrt(3)
    interval = f"[{30 - half:.1f}, {30 + half:.1f}]"
    assert f"| td3_continuous | Hopper-v4 | 30.0 | {interval} | 3 of 5 reached | 3135 +- 360" in text
    assert report.iqm([8, 1, 7, 2, 6, 3, 5, 4]) == 4.5
    assert report.summarise([5.0]) == (5.0, None, 1)
    report.main([str(runs), "--out", str(tmp_path / "default"), "--no-plots"])  # at the last step every run reached
    assert "## At 100 env steps" in (tmp_path / "default" / "report.md").read_text()
    pytest.importorskip("matplotlib")
    report.main([str(runs), "--steps", "200", "--out", str(tmp_path / "out")])
    png = (tmp_path / "out" / "Hopper-v4.png").read_bytes()
    assert png.startswith(b"\x89PNG")
    assert len(png) > 5000
    assert "| td3_continuous | Hopper-v4 | 30.0 |" in (tmp_path / "out" / "report.md").read_text()


def test_each_seeds_last_and_best_evaluation(tmp_path):
    write_run(tmp_path, "sac_discrete", "CartPole-v1", 1, [(10_000, 100), (20_000, 500), (30_000, 300)])
    write_run(tmp_path, "sac_discrete", "CartPole-v1", 2, [(10_000, 50)])
    lines = report.seed_table(report.read_runs(tmp_path)).splitlines()
    assert "| sac_discrete | CartPole-v1 | 1 | 300.0 at 30,000 | 500.0 at 20,000 |" in lines
    assert "| sac_discrete | CartPole-v1 | 2 | 50.0 at 10,000 | 50.0 at 10,000 |" in lines


def test_reference_file_is_complete():
    rows = report.read_reference()
    assert {r["algorithm"] for r in rows} == {
        "td3_continuous",
        "td7_continuous",
        "sac_continuous",
        "sac_discrete",
        "erl_td3",
    }
    assert all(r["source"] and float(r["mean"]) == float(r["mean"]) for r in rows)


def test_a_sweep_owns_its_directory(tmp_path):
    """An ad-hoc run of the same env and seed in ./runs, made with other flags, is neither resumed nor skipped by a
    sweep, which works in sweeps/td3_continuous/; the report reads only the directories it is given."""
    flags = ["--env-id", "tests.toy_envs:Counter-v0", "--seed", "1"]
    ad_hoc = run_cli(
        "td3_continuous", flags + flags_with(FLAGS[1:], total_timesteps=150, checkpoint_freq=150), tmp_path
    )
    assert ad_hoc.returncode == 0, ad_hoc.stderr
    result = sweep(tmp_path, ["tests.toy_envs:Counter-v0"])
    assert result.returncode == 0, result.stdout + result.stderr
    assert "2 runs to do (0 resumed), 0 already finished" in result.stdout
    assert len(list((tmp_path / "runs").iterdir())) == 1  # the ad-hoc run, untouched
    runs = report.read_runs(tmp_path / SWEEP)
    assert [seed for seed, _, _ in runs[("td3_continuous", "tests.toy_envs:Counter-v0")]] == [1, 2]
    assert int(runs[("td3_continuous", "tests.toy_envs:Counter-v0")][0][1][-1]) == 300  # the sweep's, not the 150


def plotted(runs, env_id="CartPole-v1", reference=(), seed_lines=False, curve_rows=()):
    """The axes report.plot_env draws for `env_id`."""
    matplotlib = pytest.importorskip("matplotlib")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots()
    report.plot_env(ax, runs, env_id, list(reference), seed_lines, list(curve_rows))
    plt.close(fig)
    return ax


def test_the_legend_covers_no_curve(tmp_path):
    """The legend is drawn beside the axes, so it hides no part of any curve, and the saved figure holds it whole."""
    pytest.importorskip("matplotlib")
    for seed in (1, 2):
        write_run(
            tmp_path, "td3_continuous", "Hopper-v4", seed, [(step, step / 10 + seed) for step in range(0, 1001, 100)]
        )
    ax = plotted(report.read_runs(tmp_path), "Hopper-v4")
    legend, axes = ax.get_legend().get_window_extent(), ax.get_window_extent()
    assert legend.x0 >= axes.x1, (legend, axes)
    (path,) = report.curves(report.read_runs(tmp_path), tmp_path)
    assert path.read_bytes().startswith(b"\x89PNG")


def test_curves_of_seeds_of_different_lengths_span_all_of_them(tmp_path):
    """Seed 1 stops at 20k, seed 2 goes on to 50k: the curve runs from the first evaluation to the last (not a stub
    over the steps both cover), averages the seeds that reached each step, its band has the line's colour, and its
    legend counts the seeds as the table does (both at 20k, one at 50k)."""
    write_run(tmp_path, "sac_discrete", "CartPole-v1", 1, [(10_000, 100), (20_000, 300)])
    write_run(tmp_path, "sac_discrete", "CartPole-v1", 2, [(10_000, 200), (20_000, 500), (50_000, 500)])
    runs = report.read_runs(tmp_path)
    ax = plotted(runs)
    (line,) = ax.lines
    assert line.get_xdata().tolist() == [10_000, 20_000, 50_000]
    assert line.get_ydata().tolist() == [150, 400, 500]
    assert matplotlib_colour(ax.collections[0].get_facecolor()[0]) == matplotlib_colour(line.get_color())
    assert ax.get_legend().get_texts()[0].get_text() == "sac_discrete (1-2 seeds)"
    assert "| 1 of 2 reached |" in report.table(runs, [50_000], reference=[])


def matplotlib_colour(colour):
    import matplotlib.colors

    return tuple(round(c, 3) for c in matplotlib.colors.to_rgb(colour))


def test_band_stays_within_the_seeds_returns(tmp_path):
    """CartPole's returns are at most 500: two seeds at 20 and 500 shade 20 to 500, never beyond (a Student-t band
    of two seeds would reach far past 500)."""
    write_run(tmp_path, "sac_discrete", "CartPole-v1", 1, [(10_000, 20), (20_000, 20)])
    write_run(tmp_path, "sac_discrete", "CartPole-v1", 2, [(10_000, 500), (20_000, 500)])
    band = plotted(report.read_runs(tmp_path)).collections[0].get_paths()[0].vertices
    assert band[:, 1].min() == 20
    assert band[:, 1].max() == 500


def test_a_single_evaluation_is_drawn_as_a_point(tmp_path):
    write_run(tmp_path, "sac_discrete", "CartPole-v1", 1, [(5_000, 42)])
    ax = plotted(report.read_runs(tmp_path))
    (line,) = ax.lines
    assert ax.get_legend().get_texts()[0].get_text() == "sac_discrete (1 seed)"
    assert line.get_marker() == "o"
    assert line.get_ydata().tolist() == [42]


def test_seed_lines_and_reference_markers(tmp_path):
    write_run(tmp_path, "td3_continuous", "Hopper-v4", 1, [(50_000, 300), (100_000, 600)])
    write_run(tmp_path, "td3_continuous", "Hopper-v4", 2, [(50_000, 500), (100_000, 900)])
    reference = [
        {"algorithm": "td3_continuous", "env_id": "Hopper-v4", "step": step, "mean": mean, "std": std}
        for step, mean, std in [("100000", "659", "752"), ("1000000", "3564", "115")]
    ]  # 1M: past the curves
    ax = plotted(report.read_runs(tmp_path), "Hopper-v4", reference, seed_lines=True)
    assert ax.get_legend().get_texts()[0].get_text() == "td3_continuous (2 seeds)"
    assert [line.get_ydata().tolist() for line in ax.lines[1:3]] == [[300, 600], [500, 900]]  # the thin seed lines
    markers = [line for line in ax.lines if line.get_marker() == "*"]
    assert [(m.get_xdata().tolist(), m.get_ydata().tolist()) for m in markers] == [([100_000], [659.0])]


def test_a_published_curve_is_a_band_of_mean_and_sd_with_its_own_legend_entry(tmp_path):
    """A reference curve on the task's -v1 env (another algorithm's and another task's rows beside it): drawn on the
    -v4 plot as a dashed mean and a band of mean +- sd up to the runs' last evaluation, with a legend entry of its
    own, and quoted in the table at the steps it has."""
    write_run(tmp_path, "td3_continuous", "Hopper-v4", 1, [(50_000, 300), (100_000, 600)])
    rows = [
        {"algorithm": algorithm, "env_id": env, "step": str(step), "mean": str(mean), "std": str(sd), "seeds": "10"}
        for algorithm, env in [
            ("td3_continuous", "Hopper-v1"),
            ("sac_continuous", "Hopper-v1"),
            ("td3_continuous", "Ant-v1"),
        ]
        for step, mean, sd in [(0, 20.0, 5.0), (50_000, 400.0, 100.0), (100_000, 659.0, 752.0), (200_000, 2000.0, 9.0)]
    ]
    for row in rows:
        row.update(measure="evaluation", source="TD3 paper's curves")
    runs = report.read_runs(tmp_path)
    ax = plotted(runs, "Hopper-v4", curve_rows=rows)
    texts = [t.get_text() for t in ax.get_legend().get_texts()]
    assert texts == ["td3_continuous (1 seed)", "TD3 paper's curves: Hopper-v1, 10 seeds (mean +- sd)"]
    (mean,) = [line for line in ax.lines if line.get_linestyle() == "--"]
    assert mean.get_xdata().tolist() == [0, 50_000, 100_000]  # 200k: past the runs
    assert mean.get_ydata().tolist() == [20.0, 400.0, 659.0]
    band = ax.collections[-1].get_paths()[0].vertices
    assert band[:, 1].min() == 659.0 - 752.0
    assert band[:, 1].max() == 659.0 + 752.0
    text = report.table(runs, [100_000], reference=[], curve_rows=rows)
    assert (
        "| td3_continuous | Hopper-v4 | 600.0 | - | 1 | 659.0 +- 752.0 (Hopper-v1, 10 seeds; TD3 paper's curves) |"
        in text
    )


def test_the_td3_papers_curves_are_the_shared_reference():
    """benchmark/reference_curves.csv holds the TD3 paper's curves as computed from the authors' learning_curves:
    seven tasks, 201 evaluation steps each, 10 seeds; HalfCheetah at 100k 5514 +- 554 (the issue's numbers)."""
    rows = report.read_reference(report.REFERENCE_CURVES)
    assert len(rows) == 7 * 201
    assert {r["seeds"] for r in rows} == {"10"}
    ((steps, means, sds),) = report.published_curves(rows, "td3_continuous", "HalfCheetah-v4").values()
    at_100k = steps == 100_000
    assert (round(float(means[at_100k][0])), round(float(sds[at_100k][0]))) == (5514, 554)


def test_report_without_matplotlib_writes_the_tables(tmp_path, monkeypatch, capsys):
    write_run(tmp_path / "runs", "td3_continuous", "Hopper-v4", 1, [(100, 5)])
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib now raises ImportError
    report.main([str(tmp_path / "runs"), "--steps", "100", "--out", str(tmp_path / "out")])
    assert "| td3_continuous | Hopper-v4 | 5.0 |" in (tmp_path / "out" / "report.md").read_text()
    assert "plots skipped" in capsys.readouterr().out
    assert not list((tmp_path / "out").glob("*.png"))


def test_report_sorts_drops_duplicates_and_names_what_it_leaves_out(tmp_path, monkeypatch, capsys):
    """Rows out of order are sorted and a step written twice counts once (a warning names the run); a run with a
    short row, a non-numeric return, no args.json or an args.json without exp_name is named in one warning and left
    out, and report.md says how many were; by default the report goes to ./report, not into the checkout."""
    runs = tmp_path / "runs"
    write_run(runs, "td3_continuous", "Hopper-v4", 1, [(200, 20), (100, 10), (200, 20), (300, 30)])
    for seed, broken in [(2, "short"), (3, "text"), (4, "no args"), (5, "no exp_name")]:
        write_run(runs, "td3_continuous", "Hopper-v4", seed, [(100, 1), (200, 2)])
        run = runs / f"Hopper-v4__td3_continuous__{seed}__0"
        if broken == "short":
            with open(run / "evaluations.csv", "a") as f:
                f.write("300,0\n")
        elif broken == "text":
            with open(run / "evaluations.csv", "a") as f:
                f.write("300,0,high,0,high\n")
        elif broken == "no args":
            (run / "args.json").unlink()
        else:
            (run / "args.json").write_text(json.dumps({"env_id": "Hopper-v4", "seed": seed}))
    monkeypatch.chdir(tmp_path)
    report.main([str(runs), "--steps", "300", "--no-plots"])
    warnings = [line for line in capsys.readouterr().err.splitlines() if line.startswith("warning: ")]
    assert len(warnings) == 6, warnings
    assert any("__1__0: 1 duplicated evaluation rows dropped" in w for w in warnings)
    assert any("__1__0: evaluation rows out of order" in w for w in warnings)
    for seed, reason in [
        (2, "short or not a number"),
        (3, "short or not a number"),
        (4, "cannot read args.json"),
        (5, "args.json has no exp_name"),
    ]:
        assert any(f"left out {runs}/Hopper-v4__td3_continuous__{seed}__0: " in w and reason in w for w in warnings)
    text = (tmp_path / "report" / "report.md").read_text()
    assert "| td3_continuous | Hopper-v4 | 30.0 | - | 1 |" in text
    assert "4 runs could not be read and are left out" in text
    runs_read = report.read_runs(runs)
    ((_, steps, returns),) = runs_read[("td3_continuous", "Hopper-v4")]
    assert steps.tolist() == [100, 200, 300]
    assert returns.tolist() == [10, 20, 30]
