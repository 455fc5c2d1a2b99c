"""A catalogue of bad input, driven through all five scripts: each case must end with one `error:` line naming the
flag or file, a non-zero exit, no traceback, no run directory and nothing on disk changed. Most cases run
in-process (they fail before the first env step, so they are fast); tyro's parse errors and one case of each
kind also run through the real command line."""

import importlib
import json
import resource
import shutil
import subprocess
import sys
from contextlib import nullcontext
from dataclasses import fields
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.conftest import (
    check_memory,
    DEFAULT_ENV,
    REPO,
    SCRIPTS,
    TINY,
    address_space_limit,
    cli_env,
    flags_with,
    load_checkpoint,
    run_cli,
    run_main,
    toy_env,
)

# flags, and what the error line must contain. {resume}, {model} and {run} stand for the shared tiny run's files.
COMMON = {
    "unknown env": (["--env-id", "NoSuchEnv-v0"], "--env-id 'NoSuchEnv-v0'"),
    # gymnasium would run the latest version silently, in a directory whose name does not say which (issue 35)
    "env id without a version": (["--env-id", "Hopper"], "--env-id Hopper names no version; gymnasium has Hopper-v"),
    "zero steps": (["--total-timesteps", "0"], "--total-timesteps must be positive"),
    "negative buffer": (["--buffer-size", "-5"], "--buffer-size must be positive"),
    "batch above buffer": (["--batch-size", "512", "--buffer-size", "100"], "--batch-size 512 is larger"),
    "no update would happen": (["--total-timesteps", "1000", "--learning-starts", "1000"], "--learning-starts must be"),
    "replay larger than memory": (["--buffer-size", "1000000000000"], "lower --buffer-size"),
    "missing resume": (["--resume", "missing.pt"], "cannot read --resume file missing.pt"),
    "garbage resume": (["--resume", "garbage.pt"], "cannot read --resume file garbage.pt"),
    "model as resume": (["--resume", "{model}"], "is not a checkpoint.pt"),
    "another script's checkpoint as resume": (
        ["--resume", "{other}"],
        "was made by {other_script}.py, not {script}.py",
    ),
    "checkpoint from before checkpoints named their script": (
        ["--resume", "{unnamed}"],
        "was made by an older version of this script, not {script}.py",
    ),
    "mismatched resume": (["--resume", "{resume}", "--batch-size", "64"], "was made with --batch-size 32, not 64"),
    "resume without steps left": (
        ["--resume", "{resume}", "--total-timesteps", "400"],
        "--total-timesteps 400 is not beyond",
    ),
    "runs is a file": (["--env-id", "{env}"], "runs"),
}
# The cases of the run machinery rebuilt (issue 19); the scripts that have it so far.
LIFECYCLE = {
    "negative seed": (["--seed", "-1"], "--seed must be non-negative, got -1"),
    "seed too large": (["--seed", str(2**32)], "--seed must lie in [0, 2**31)"),
    "exp name with a slash": (["--exp-name", "a/../b"], "--exp-name 'a/../b' must be a plain file name"),
    "exp name too long": (["--exp-name", "x" * 300], "must be a plain file name of 1-100"),
    "empty resume": (["--resume", ""], "--resume needs the path"),
    "too many evaluation episodes": (["--eval-episodes", "1000000000"], "--eval-episodes must be at most 1000"),
    "batch larger than memory": (
        ["--batch-size", "1000000000", "--buffer-size", "1000000000"],  # the batch and the rows: beyond any host
        "lower --buffer-size or --batch-size",
    ),
}
ODD_ACTIONS = {  # action spaces that were accepted and then sent wrong actions
    "matrix of actions": (["--env-id", "tests.toy_envs:CounterMatrixAction-v0"], "a bounded Box of one dimension"),
    "discrete actions not from 0": (["--env-id", "tests.toy_envs:DiscreteCounterShifted-v0"], "start=1"),
}
LIFECYCLE_SCRIPTS = SCRIPTS
OWN = {
    "td3_continuous": {"wrong action space": (["--env-id", "CartPole-v1"], "Discrete action space")},
    "sac_continuous": {
        "wrong action space": (["--env-id", "CartPole-v1"], "Discrete action space"),
        "one critic": (["--num-critics", "1"], "--num-critics must be at least 2"),
    },
    "sac_discrete": {
        "wrong action space": (["--env-id", "Pendulum-v1"], "has actions Box("),
        "ratio of one": (["--target-entropy-ratio", "1.0"], "--target-entropy-ratio must lie in (0, 1)"),
        "atari replay larger than memory": (
            ["--env-id", "PongNoFrameskip-v4", "--buffer-size", "10000000"],
            "lower --buffer-size",
        ),
    },
    "td7_continuous": {
        "wrong action space": (["--env-id", "CartPole-v1"], "Discrete action space"),
        "reset weight zero": (["--reset-weight", "0"], "--reset-weight must be positive"),
        "reset weight above one": (["--reset-weight", "1.5"], "--reset-weight must lie in [0, 1]"),
        "offline without dataset": (["--offline"], "--offline needs --dataset"),
        "dataset without offline": (["--dataset", "data.npz"], "--dataset is only read with --offline"),
        "ignored offline flag": (
            ["--offline", "--dataset", "data.npz", "--learning-starts", "10"],
            "--learning-starts has no effect with --offline",
        ),
        "missing dataset": (["--offline", "--dataset", "missing.npz"], "cannot read --dataset"),
        "empty dataset": (["--offline", "--dataset", "empty.npz"], "holds no transitions"),
        "dataset of the wrong env": (["--offline", "--dataset", "narrow.npz"], "observations has shape"),
        "non-finite dataset": (["--offline", "--dataset", "nan.npz"], "rewards holds a non-finite"),
        "several envs with checkpoints": (["--num-envs", "2"], "--num-envs above 1 needs"),
    },
    "erl_td3": {
        "wrong action space": (["--env-id", "CartPole-v1"], "Discrete action space"),
        "elites crowd out learners": (["--num-elites", "10"], "exceed --pop-size"),
        "no elite": (["--num-elites", "0"], "--num-elites must be positive"),
        "learning starts beyond the buffer": (
            ["--learning-starts", "300", "--buffer-size", "200"],
            "--learning-starts must be below --buffer-size",
        ),
        "probability above one": (["--mutation-prob", "1.5"], "--mutation-prob must lie in [0, 1]"),
    },
}
CASES = [(script, case) for script in SCRIPTS for case in {**COMMON, **OWN[script]}]
CASES += [(script, case) for script in LIFECYCLE_SCRIPTS for case in LIFECYCLE]
CASES += [
    (script, "discrete actions not from 0" if script == "sac_discrete" else "matrix of actions")
    for script in LIFECYCLE_SCRIPTS
]


def float_flags(script):
    """Every float flag of a script (importing it registers nothing and runs nothing)."""
    module = __import__(script)
    return [f.name for f in fields(module.Args) if f.type in (float, "float")]


NON_FINITE = [(script, name, value) for script in SCRIPTS for name in float_flags(script) for value in ("nan", "inf")]


def snapshot(directory):
    """Every file under `directory` with its bytes: what a failed start must leave as it was."""
    return {p: p.read_bytes() for p in sorted(Path(directory).rglob("*")) if p.is_file()}


def other_script(script):
    """A script whose checkpoint `script` must refuse."""
    return "td3_continuous" if script == "sac_continuous" else "sac_continuous"


def prepare(tmp_path, script, tiny_runs, case):
    """The files the cases refer to: a garbage checkpoint, datasets, and a copy of the shared tiny run (and, for the
    case that needs them, another script's checkpoint, and one without the name of the script that made it)."""
    (tmp_path / "garbage.pt").write_bytes(b"not a checkpoint")
    dataset = {
        "observations": np.zeros((5, 11)),
        "actions": np.zeros((5, 3)),
        "rewards": np.zeros(5),
        "next_observations": np.zeros((5, 11)),
        "terminals": np.zeros(5),
    }
    np.savez(tmp_path / "data.npz", **dataset)
    np.savez(tmp_path / "empty.npz", **{k: v[:0] for k, v in dataset.items()})
    np.savez(tmp_path / "narrow.npz", **{**dataset, "observations": np.zeros((5, 3))})
    np.savez(tmp_path / "nan.npz", **{**dataset, "rewards": np.array([0, 0, np.nan, 0, 0])})
    run = tmp_path / "saved" / Path(tiny_runs(script)).name
    shutil.copytree(tiny_runs(script), run)
    if case == "another script's checkpoint as resume":
        shutil.copy(Path(tiny_runs(other_script(script))) / "checkpoint.pt", tmp_path / "other.pt")
    if case == "checkpoint from before checkpoints named their script":
        checkpoint = torch.load(run / "checkpoint.pt", map_location="cpu", weights_only=False)
        del checkpoint["script"]
        torch.save(checkpoint, tmp_path / "unnamed.pt")
    return run


def resolve(flags, run, script):
    names = {"resume": run / "checkpoint.pt", "model": run / "model.pt", "run": run, "env": DEFAULT_ENV[script]}
    names.update(other="other.pt", unnamed="unnamed.pt", script=script, other_script=other_script(script))
    return [f.format(**names) for f in flags]


def assert_refused(stderr, expected, before, cwd):
    """One `error:` line on stderr with `expected` in it, no traceback, no run directory, nothing on disk changed."""
    lines = stderr.strip().splitlines()
    assert len(lines) == 1, stderr
    assert lines[0].startswith("error: "), stderr
    assert expected in lines[0], stderr
    assert "Traceback" not in stderr
    assert not (cwd / "runs").is_dir()  # no run directory
    assert snapshot(cwd) == before  # nothing on disk changed


@pytest.mark.parametrize("script,case", CASES)
def test_bad_input(script, case, tmp_path, tiny_runs, monkeypatch, capsys):
    flags, expected = {**COMMON, **OWN[script], **LIFECYCLE, **ODD_ACTIONS}[case]
    run = prepare(tmp_path, script, tiny_runs, case)
    flags, (expected,) = resolve(flags, run, script), resolve([expected], run, script)
    if case == "runs is a file":
        (tmp_path / "runs").write_text("a file where the run directory should go")
    before = snapshot(tmp_path)
    # The cases that need the defaults (TD7 offline, Atari's replay) start from them; the others from the tiny run's.
    bare = "--offline" in flags or "atari" in case
    base = ["--no-cuda", "--torch-threads", "1"] if bare else flags_with(TINY, total_timesteps=800)
    # A memory check that let a case through would allocate it: let that fail here, not summon the OOM killer.
    room = 4 * 2**30 if "memory" in case else resource.RLIM_INFINITY
    with pytest.raises(SystemExit) as exit_info, address_space_limit(room) if "memory" in case else nullcontext():
        run_main(script, base + flags, tmp_path, monkeypatch)
    assert exit_info.value.code == 1
    assert_refused(capsys.readouterr().err, expected, before, tmp_path)


@pytest.mark.parametrize("script,name,value", NON_FINITE)
def test_non_finite_float_flag(script, name, value, tmp_path, monkeypatch, capsys):
    before = snapshot(tmp_path)
    with pytest.raises(SystemExit) as exit_info:
        run_main(script, flags_with(TINY, **{name: value}), tmp_path, monkeypatch)
    assert exit_info.value.code == 1
    assert_refused(capsys.readouterr().err, f"--{name.replace('_', '-')} must be a finite", before, tmp_path)


TYRO = {
    "misspelled flag": (["--sed", "3"], "--seed"),
    "not a number": (["--seed", "abc"], "--seed"),
    "missing value": (["--learning-starts"], "--learning-starts"),
}


@pytest.mark.parametrize("case", TYRO)
def test_parse_errors_in_tyros_words(case, tmp_path):
    """A command line tyro cannot parse: tyro's own message (its box, naming the flag), exit status 2, no traceback,
    nothing written."""
    flags, expected = TYRO[case]
    result = run_cli("td3_continuous", flags, tmp_path, timeout=60)
    assert result.returncode == 2
    assert expected in result.stderr
    assert "Traceback" not in result.stderr
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("script", SCRIPTS)
def test_through_the_command_line(script, tmp_path):
    """The in-process cases end in SystemExit; here one of them runs as a user runs it: exit status 1, one line."""
    result = run_cli(script, ["--total-timesteps", "0"], tmp_path, timeout=60)
    assert result.returncode == 1
    assert_refused(result.stderr, "--total-timesteps must be positive", {}, tmp_path)


def test_runs_in_the_same_second_each_get_a_directory(tmp_path, monkeypatch, capsys):
    """Same env, seed and exp-name, the clock stopped (runs started in one second): the second and third runs take
    the first one's name with -2 and -3, say so on their first line, and finish; the first run's files stay as they
    were."""
    import td3_continuous

    monkeypatch.setattr(td3_continuous.time, "time", lambda: 1_800_000_000.0)
    flags = flags_with(
        TINY,
        env_id=toy_env("td3_continuous", "Counter-v0"),
        total_timesteps=100,
        learning_starts=50,
        eval_freq=50,
        checkpoint_freq=100,
    )
    first = run_main("td3_continuous", flags, tmp_path, monkeypatch)
    capsys.readouterr()
    before = snapshot(first["run_dir"])
    for n, batch_size in [(2, 16), (3, 8)]:
        run = run_main("td3_continuous", flags_with(flags, batch_size=batch_size), tmp_path, monkeypatch)
        assert run["run_dir"] == f"{first['run_dir']}-{n}" and run["global_step"] == 100
        assert capsys.readouterr().out.startswith(f"run {run['run_dir']}: ")
        assert json.loads((Path(run["run_dir"]) / "args.json").read_text())["batch_size"] == batch_size
    assert snapshot(first["run_dir"]) == before


@pytest.mark.parametrize("script", SCRIPTS)
def test_non_finite_observation_before_learning_is_named(script, tmp_path):
    """An env whose observation turns NaN at its 100th step, in the random phase (ERL: before the first update): the
    run stops at once, naming the observation and its step, before the bad row could be stored."""
    learning_starts = 150 if script == "erl_td3" else 1500  # ERL: stored steps, at most --buffer-size 1000
    flags = flags_with(
        TINY,
        env_id=toy_env(script, "CounterNanObs-v0"),
        total_timesteps=2000,
        learning_starts=learning_starts,
        checkpoint_freq=0,
        eval_freq=0,
    )
    result = run_cli(script, flags, tmp_path, timeout=300)
    assert result.returncode == 1
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("error: non-finite observation at global_step "), result.stderr
    step = int(lines[0].split("global_step ")[1].split(";")[0])
    assert 100 <= step <= (110 if script == "erl_td3" else 102)  # ERL: the population's 10 envs step together


def test_checkpoint_holds_only_the_filled_rows(tmp_path, monkeypatch):
    """400 rows filled in a buffer of a million: the checkpoint stores the 400, not the preallocated storage."""
    run = run_main("td3_continuous", flags_with(TINY, buffer_size=10**6), tmp_path, monkeypatch)
    size = (Path(run["run_dir"]) / "checkpoint.pt").stat().st_size
    row_bytes = 4 * (2 * 11 + 3 + 2)  # Hopper: obs, action, reward, terminated, next_obs in float32
    assert len(load_checkpoint(run["run_dir"])["state"]["rb"]["data"]) == 400
    assert size < 10**6 * row_bytes / 20, f"{size / 2**20:.1f} MiB"


@pytest.mark.parametrize("script", SCRIPTS)
def test_track_where_wandb_cannot_start(script, tmp_path):
    """--track without a W&B key (WANDB_MODE unset, no WANDB_API_KEY, no ~/.netrc): wandb.init's own error as one
    line and exit status 1, no traceback. (Issue 35: no longer checked before the run, so its directory is claimed by
    then; what the line promises is that the run does not go on without the tracking asked for.)"""
    env = {name: value for name, value in cli_env().items() if not name.startswith("WANDB_") or name == "WANDB_SILENT"}
    flags = flags_with(TINY, total_timesteps=250, eval_freq=0) + ["--track"]
    result = subprocess.run(
        [sys.executable, str(REPO / f"{script}.py"), *flags],
        cwd=tmp_path,
        env={**env, "HOME": str(tmp_path)},
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 1, result.stderr
    lines = [line for line in result.stderr.strip().splitlines() if not line.startswith("warning:")]
    assert len(lines) == 1 and lines[0].startswith("error: --track: wandb cannot start"), result.stderr
    assert "Traceback" not in result.stderr
    assert not list(tmp_path.glob("runs/*/checkpoint.pt"))  # it stopped before training


@pytest.mark.parametrize("script", SCRIPTS)
def test_memory_check_counts_the_buffer_and_its_checkpoint_copy(script, host_memory, monkeypatch, capsys):
    """The replay buffer's bytes against the device's free memory: on the CPU twice (the buffer and a checkpoint's
    copy of it), on a GPU once there and once on the host; one line naming both amounts when it does not fit. (Issue
    35 replaced the meta-device estimate of every network, and its count of conv activations, with this and the
    out-of-memory line below.)"""
    module = importlib.import_module(script)
    cpu, cuda, gib = torch.device("cpu"), torch.device("cuda"), 2**30
    host_memory["free"] = 10 * gib
    check_memory(module, cpu, int(4.9 * gib), monkeypatch)
    with pytest.raises(SystemExit) as exit_info:
        check_memory(module, cpu, int(5.1 * gib), monkeypatch)
    assert exit_info.value.code == 1
    assert capsys.readouterr().err.strip().splitlines() == [
        "error: the replay buffer needs 10.2 GiB, more than the 10.0 GiB free on the cpu; lower --buffer-size or "
        "--batch-size"
    ]
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (2 * gib, 80 * gib))
    check_memory(module, cuda, int(1.9 * gib), monkeypatch)  # once on the GPU, once (its checkpoint copy) on the host
    with pytest.raises(SystemExit):
        check_memory(module, cuda, int(2.1 * gib), monkeypatch)
    assert "more than the 2.0 GiB free on the cuda" in capsys.readouterr().err
    host_memory["free"] = 1 * gib
    with pytest.raises(SystemExit):
        check_memory(module, cuda, int(1.5 * gib), monkeypatch)
    assert "more than the 1.0 GiB free on the cpu" in capsys.readouterr().err


@pytest.mark.parametrize("script", SCRIPTS)
def test_the_memory_check_counts_buffer_and_batch(script, tmp_path, monkeypatch):
    """main asks the memory check about the replay's rows and a batch's: bytes that grow with --buffer-size and with
    --batch-size, and nothing else (a batch larger than memory is refused too, before anything is allocated)."""
    module = importlib.import_module(script)
    asked = []

    def choose_device(args, buffer_bytes, *rest, **kwargs):
        asked.append(buffer_bytes)
        raise KeyboardInterrupt  # main goes no further: nothing allocated, nothing written

    monkeypatch.setattr(module, "choose_device", choose_device)
    for buffer_size, batch_size in [(1000, 32), (2000, 32), (1000, 64)]:
        with pytest.raises(KeyboardInterrupt):
            run_main(script, flags_with(TINY, buffer_size=buffer_size, batch_size=batch_size), tmp_path, monkeypatch)
    both, per_buffer_rows, per_batch = asked[0], asked[1] - asked[0], asked[2] - asked[0]
    assert per_buffer_rows > 0 and per_batch > 0
    assert both == per_buffer_rows + per_batch  # (1000 rows and 32 of a batch: as much as the two increases)
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize("script", SCRIPTS)
def test_an_update_that_cannot_allocate(script, tmp_path):
    """An allocation that the memory check let through (here an update's activations for a batch of a million rows
    under an address-space limit of 4 GiB, where the replay itself fits) ends the run with one line naming the memory
    and the flags to lower, exit status 1, no traceback. (Issue 35: this line replaces the meta-device model of every
    network that tried to foresee it.)"""
    flags = flags_with(
        TINY,
        total_timesteps=300,
        learning_starts=200,
        batch_size=10**6,
        buffer_size=10**6,
        eval_freq=0,
        checkpoint_freq=0,
    )

    def limit():
        resource.setrlimit(resource.RLIMIT_AS, (4 * 2**30, resource.getrlimit(resource.RLIMIT_AS)[1]))

    result = subprocess.run(
        [sys.executable, str(REPO / f"{script}.py"), *flags],
        cwd=tmp_path,
        env=cli_env(),
        capture_output=True,
        text=True,
        timeout=300,
        preexec_fn=limit,
    )
    assert result.returncode == 1, result.stderr
    lines = [line for line in result.stderr.strip().splitlines() if not line.startswith("warning:")]
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("error: out of memory") and "lower --buffer-size or --batch-size" in lines[0], lines
    assert "Traceback" not in result.stderr
    assert not list(tmp_path.glob("runs/*/lock"))  # the run gave its directory up
