"""A catalogue of bad input, driven through all five scripts: each case must end with one `error:` line naming the
flag or file, a non-zero exit, no traceback, no run directory and nothing on disk changed. Most cases run
in-process (they fail before the first env step, so they are fast); tyro's parse errors and one case of each
kind also run through the real command line."""

import json
import shutil
from dataclasses import fields
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import DEFAULT_ENV, SCRIPTS, TINY, flags_with, load_checkpoint, run_cli, run_main, toy_env

# flags, and what the error line must contain. {resume}, {model} and {run} stand for the shared tiny run's files.
COMMON = {
    "unknown env": (["--env-id", "NoSuchEnv-v0"], "--env-id 'NoSuchEnv-v0'"),
    "zero steps": (["--total-timesteps", "0"], "--total-timesteps must be positive"),
    "negative buffer": (["--buffer-size", "-5"], "--buffer-size must be positive"),
    "batch above buffer": (["--batch-size", "512", "--buffer-size", "100"], "--batch-size 512 is larger"),
    "no update would happen": (["--total-timesteps", "1000", "--learning-starts", "1000"], "--learning-starts 1000"),
    "replay larger than memory": (["--buffer-size", "1000000000000"], "lower --buffer-size"),
    "missing resume": (["--resume", "missing.pt"], "cannot read --resume file missing.pt"),
    "garbage resume": (["--resume", "garbage.pt"], "cannot read --resume file garbage.pt"),
    "model as resume": (["--resume", "{model}"], "is not a checkpoint.pt"),
    "mismatched resume": (["--resume", "{resume}", "--batch-size", "64"], "was made with --batch-size 32, not 64"),
    "resume without steps left": (
        ["--resume", "{resume}", "--total-timesteps", "400"],
        "--total-timesteps 400 is not beyond",
    ),
    "runs is a file": (["--env-id", "{env}"], "runs"),
    "cudagraphs without a GPU": (["--cudagraphs"], "--cudagraphs needs a GPU: --no-cuda is set"),
}
# The cases of the run machinery rebuilt (issue 19); the scripts that have it so far.
LIFECYCLE = {
    "negative seed": (["--seed", "-1"], "--seed must lie in [0, 2**31)"),
    "seed too large": (["--seed", str(2**32)], "--seed must lie in [0, 2**31)"),
    "exp name with a slash": (["--exp-name", "a/../b"], "--exp-name 'a/../b' must be a plain file name"),
    "exp name too long": (["--exp-name", "x" * 300], "must be a plain file name of 1-100"),
    "empty resume": (["--resume", ""], "--resume needs the path"),
    "too many evaluation episodes": (["--eval-episodes", "1000000000"], "--eval-episodes must be at most 1000"),
    "batch larger than memory": (
        ["--batch-size", "100000000", "--buffer-size", "100000000"],
        "lower --buffer-size or --batch-size",
    ),
    "track without a wandb key": (["--track"], "--track needs a wandb key"),
}
ODD_ACTIONS = {  # action spaces that were accepted and then sent wrong actions
    "matrix of actions": (["--env-id", "tests.toy_envs:CounterMatrixAction-v0"], "a bounded Box of one dimension"),
    "discrete actions not from 0": (["--env-id", "tests.toy_envs:DiscreteCounterShifted-v0"], "numbered from 1"),
}
LIFECYCLE_SCRIPTS = SCRIPTS
OWN = {
    "td3_continuous": {"wrong action space": (["--env-id", "CartPole-v1"], "Discrete action space")},
    "sac_continuous": {
        "wrong action space": (["--env-id", "CartPole-v1"], "Discrete action space"),
        "one critic": (["--num-critics", "1"], "--num-critics must be at least 2"),
    },
    "sac_discrete": {
        "wrong action space": (["--env-id", "Pendulum-v1"], "Box action space"),
        "ratio of one": (["--target-entropy-ratio", "1.0"], "--target-entropy-ratio must lie in (0, 1)"),
        "cudagraphs with images": (["--env-id", "PongNoFrameskip-v4", "--cudagraphs", "--cuda"], "--cudagraphs"),
        "atari replay larger than memory": (
            ["--env-id", "PongNoFrameskip-v4", "--buffer-size", "10000000"],
            "lower --buffer-size",
        ),
        # 324 GiB with the conv layers' activations, 11 counting their biases alone: a real check of that count only
        # on a host with more than 11 GiB free; tests/test_sac.py::test_conv_activations_are_counted is one anywhere.
        "atari batch larger than memory": (
            ["--env-id", "PongNoFrameskip-v4", "--batch-size", "200000", "--buffer-size", "200000"],
            "lower --buffer-size or --batch-size",
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
            "--learning-starts 300",
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


def prepare(tmp_path, script, tiny_runs):
    """The files the cases refer to: a garbage checkpoint, datasets, and a copy of the shared tiny run."""
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
    return run


def resolve(flags, run, script):
    return [
        f.format(resume=run / "checkpoint.pt", model=run / "model.pt", run=run, env=DEFAULT_ENV[script]) for f in flags
    ]


def assert_refused(stderr, expected, before, cwd):
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
    if case == "track without a wandb key":
        for name in ("WANDB_MODE", "WANDB_API_KEY"):
            monkeypatch.delenv(name, raising=False)
        monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.netrc
    run = prepare(tmp_path, script, tiny_runs)
    flags = resolve(flags, run, script)
    if case == "runs is a file":
        (tmp_path / "runs").write_text("a file where the run directory should go")
    before = snapshot(tmp_path)
    # The cases that need the defaults (TD7 offline, Atari's replay) start from them; the others from the tiny run's.
    bare = "--offline" in flags or "atari" in case
    base = ["--no-cuda", "--torch-threads", "1"] if bare else flags_with(TINY, total_timesteps=800)
    with pytest.raises(SystemExit) as exit_info:
        run_main(script, base + flags, tmp_path, monkeypatch)
    message = str(exit_info.value.code)
    assert message.startswith("error: "), message
    assert_refused(message + "\n" + capsys.readouterr().err, expected, before, tmp_path)


@pytest.mark.parametrize("script,name,value", NON_FINITE)
def test_non_finite_float_flag(script, name, value, tmp_path, monkeypatch, capsys):
    before = snapshot(tmp_path)
    with pytest.raises(SystemExit) as exit_info:
        run_main(script, flags_with(TINY, **{name: value}), tmp_path, monkeypatch)
    message = str(exit_info.value.code)
    assert_refused(
        message + "\n" + capsys.readouterr().err, f"--{name.replace('_', '-')} must be a finite", before, tmp_path
    )


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


def test_two_runs_in_the_same_second_get_their_own_directories(tmp_path, monkeypatch):
    """Same env, seed and exp-name, the clock stopped: the second run takes another name, and each directory holds
    only its own run."""
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
    second = run_main("td3_continuous", flags_with(flags, batch_size=16), tmp_path, monkeypatch)
    assert first["run_dir"] != second["run_dir"]
    assert Path(second["run_dir"]).name.startswith(Path(first["run_dir"]).name)
    for run, batch_size in [(first, 32), (second, 16)]:
        assert json.loads((Path(run["run_dir"]) / "args.json").read_text())["batch_size"] == batch_size
        assert load_checkpoint(run["run_dir"])["args"]["batch_size"] == batch_size
        assert len((Path(run["run_dir"]) / "evaluations.csv").read_text().splitlines()) == 1 + 2


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
